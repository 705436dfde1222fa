"""Run configs: the pydantic schema, TOML presets (`configs/*.toml`) and their composition."""

from meshrl.configs.loader import ConfigError, load_config, to_toml
from meshrl.configs.schema import (
    CustomLoss,
    DppoKlLoss,
    IpoLoss,
    LossConfig,
    MisLoss,
    RefKlLoss,
    ReplayChannel,
    RunConfig,
    SdpoChannel,
    TisLoss,
)

__all__ = [
    "ConfigError",
    "CustomLoss",
    "DppoKlLoss",
    "IpoLoss",
    "LossConfig",
    "MisLoss",
    "RefKlLoss",
    "ReplayChannel",
    "RunConfig",
    "SdpoChannel",
    "TisLoss",
    "load_config",
    "to_toml",
]
