"""Loss adapters: PRIME-RL's per-sample hook (DPPO+KL, IPO, ref-KL, TIS/MIS corrections), replay DPO/SimPO,
SDPO generalized JSD, chunked LM-head logprobs, and the composer the trainer calls."""

from meshrl.loss_adapters.compose import compose_loss, rl_loss_fn
from meshrl.loss_adapters.corrections import mis_loss_fn, tis_loss_fn
from meshrl.loss_adapters.logprobs import chunked_token_logprobs, sequence_token_logprobs
from meshrl.loss_adapters.prime_rl import LossInputs, LossOutputs, ipo_loss_fn, loss_fn, ref_kl_loss_fn
from meshrl.loss_adapters.replay import dpo_loss, replay_loss, simpo_loss
from meshrl.loss_adapters.sdpo import generalized_jsd

__all__ = [
    "LossInputs",
    "LossOutputs",
    "chunked_token_logprobs",
    "compose_loss",
    "dpo_loss",
    "generalized_jsd",
    "ipo_loss_fn",
    "loss_fn",
    "mis_loss_fn",
    "ref_kl_loss_fn",
    "replay_loss",
    "rl_loss_fn",
    "sequence_token_logprobs",
    "simpo_loss",
    "tis_loss_fn",
]
