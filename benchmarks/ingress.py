"""Ingress throughput over loopback, CURVE against plain TCP, and the verifier's cost in a run.

    python benchmarks/ingress.py [--groups 200] [--weights-mb 256] [--run-steps 12] [--repeats 3]

1. Accepted rollouts/s: one client submits honest groups (the embedded default's tiny model,
   fp32, 4 samples per group) under fresh leases as fast as the controller verifies them —
   prompt re-render, tool replay, reward, and the re-scoring of `verify_fraction` of the tokens
   — with CURVE and without; and with re-scoring off, to show what the transport costs.
2. Weight distribution MB/s: a client downloads a `--weights-mb` safetensors file in chunks,
   sha256 checked, with CURVE and without.
3. The verifier's cost as a fraction of a training step: a real `train` (configs/local.toml,
   no warm start) with two `meshrl rollout-worker` processes; per step, the seconds the
   verifier spent over the trainer's step time (medians over steps 2..).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from meshrl.configs import load_config
from meshrl.configs.schema import IngressConfig, TaskConfig, TinyModelConfig
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import save_weights_file
from meshrl.ingress.client import RolloutClient, to_episode
from meshrl.ingress.keys import generate_keys
from meshrl.ingress.protocol import GroupResult, Spec
from meshrl.ingress.server import IngressServer, model_files
from meshrl.ingress.verify import Scorer, Verifier
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.run.controller import train
from meshrl.run.run_dir import RunDir
from meshrl.tasks.base import make_task

TASK = TaskConfig(kwargs={"key_len": 1, "n_keys": 3})
MAX_NEW = 40


def server(root: Path, model: Path, curve: bool, fraction: float) -> IngressServer:
    keys = root / "keys"
    config = IngressConfig(bind="tcp://127.0.0.1:*", server_key=str(keys / "server.key_secret"),
                           authorized_keys=str(keys / "authorized"), verify_fraction=fraction)  # fmt: skip
    spec = Spec(task_import_path=TASK.import_path, task_kwargs=TASK.kwargs, temperature=1.0, top_p=1.0,
                max_new_tokens=MAX_NEW, dtype="float32", renderer="template", tool_parser="hermes", chat_template_kwargs={}, model_files=model_files(model),
                max_episode_tokens=65536, max_tool_result_tokens=1024)  # fmt: skip
    holder: list[IngressServer] = []
    scorer = Scorer(str(model), "float32", 1.0, lambda v: holder[0].weights_path(v))
    fmt = EpisodeFormat(AutoTokenizer.from_pretrained(str(model)), make_task(TASK))
    verifier = Verifier(fmt, scorer, max_new_tokens=MAX_NEW, fraction=fraction, tolerance=config.verify_tolerance)
    holder.append(IngressServer(config, spec, verifier, curve=curve))
    return holder[0]


def client(root: Path, srv: IngressServer, curve: bool) -> RolloutClient:
    keys = root / "keys"
    if curve:
        return RolloutClient(srv.address, keys / "server.key", keys / "worker.key_secret")
    return RolloutClient(srv.address, None, None)


def rollouts_per_s(root: Path, model: Path, curve: bool, fraction: float, groups: int) -> float:
    srv = server(root, model, curve, fraction)
    engine = HFEngine.from_pretrained(str(model))
    weights = root / f"w_{curve}_{fraction}.safetensors"
    save_weights_file(engine.model.state_dict(), weights)
    srv.publish(0, weights)
    (prompt,) = make_task(TASK).sample_prompts(random.Random(0), 1)
    srv.offer(0, [GroupRequest(f"0/{i}", prompt, 4, 0, 0) for i in range(groups)])
    c = client(root, srv, curve)
    leases = c.lease(64)
    fmt = EpisodeFormat(AutoTokenizer.from_pretrained(str(model)), make_task(TASK))
    scheduler = EpisodeScheduler(engine, fmt, Sampling(1.0, 1.0, MAX_NEW), max_episodes=8, max_tokens=8192)
    scheduler.submit([GroupRequest("sample", prompt, 4, 1, 0)])
    sampled = []
    while not sampled:
        sampled = scheduler.take(1.0)
    scheduler.close()
    episodes = [to_episode(r) for r in sampled[0].rollouts]  # one honest group, submitted under every lease
    start, accepted = time.perf_counter(), 0
    while leases:
        for lease in leases:
            (verdict,) = c.submit([GroupResult(lease_id=lease.lease_id, episodes=episodes)])
            accepted += verdict.status == "accepted"
        leases = c.lease(64)
    seconds = time.perf_counter() - start
    c.close()
    srv.close()
    assert accepted == groups, accepted
    return accepted * 4 / seconds


def weights_mb_per_s(root: Path, model: Path, curve: bool, megabytes: int) -> float:
    srv = server(root, model, curve, 0.0)
    path = root / f"big_{curve}.safetensors"
    save_weights_file({f"w{i}": torch.randn(1 << 20) for i in range(megabytes // 4)}, path)
    srv.publish(0, path)
    size = path.stat().st_size
    c = client(root, srv, curve)
    start = time.perf_counter()
    c.weights(0)
    seconds = time.perf_counter() - start
    c.close()
    srv.close()  # removes the file it served
    return size / 2**20 / seconds


def verifier_share(root: Path, steps: int) -> tuple[float, float, float, float]:
    """(verify s per step, train s per step, their ratio, outside rollouts per step), medians."""
    keys = root / "keys"
    out = root / "run"
    address = "tcp://127.0.0.1:47931"
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshrl.cli.main",
                "rollout-worker",
                "--connect",
                address,
                "--server-key",
                str(keys / "server.key"),
                "--key",
                str(keys / f"{name}.key_secret"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for name in ("worker", "worker2")
    ]
    try:
        config = load_config(["@", "configs/local.toml", "--trainer.warm_start_steps", "0", "--max-steps", str(steps),
                              "--output-dir", str(out), "--metrics.progress", "plain", "--ingress.bind", address,
                              "--ingress.server_key", str(keys / "server.key_secret"),
                              "--ingress.authorized_keys", str(keys / "authorized")])  # fmt: skip
        train(config)
    finally:
        for w in workers:
            w.terminate()
            w.wait()
    records = RunDir(out).read_metrics()
    verify = [b["ingress/verify_s"] - a["ingress/verify_s"] for a, b in zip(records, records[1:])][1:]
    trains = [r["time/train"] for r in records[2:]]
    ratios = [v / t for v, t in zip(verify, trains)]
    external = [r["rollouts/external"] for r in records[2:]]
    return statistics.median(verify), statistics.median(trains), statistics.median(ratios), statistics.median(external)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--weights-mb", type=int, default=256)
    parser.add_argument("--run-steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (medians printed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = ensure_tiny(root / "tiny", TinyModelConfig())
        generate_keys(root / "keys", "server")
        for name in ("worker", "worker2"):
            generate_keys(root / "keys" / "authorized", name)
            for suffix in (".key", ".key_secret"):
                (root / "keys" / f"{name}{suffix}").write_bytes(
                    (root / "keys" / "authorized" / f"{name}{suffix}").read_bytes()
                )
            (root / "keys" / "authorized" / f"{name}.key_secret").unlink()
        fraction = IngressConfig().verify_fraction
        print(
            f"accepted rollouts/s ({args.groups} groups of 4, tiny model fp32, one client, median of {args.repeats}):"
        )
        runs: dict[tuple[bool, float], list[float]] = {}
        for _ in range(args.repeats):  # alternated, so drift on the machine hits every mode alike
            for curve in (False, True):
                for frac in (0.0, fraction):
                    runs.setdefault((curve, frac), []).append(rollouts_per_s(root, model, curve, frac, args.groups))
        rates = {mode: statistics.median(values) for mode, values in runs.items()}
        for (curve, frac), rate in rates.items():
            spread = ", ".join(f"{v:.0f}" for v in runs[curve, frac])
            print(f"  {'CURVE' if curve else 'plain':<6} verify_fraction {frac:<5} {rate:8.1f}   (runs: {spread})")
        print(f"  CURVE / plain at verify_fraction {fraction}: {rates[True, fraction] / rates[False, fraction]:.2f}")
        print(f"weight distribution ({args.weights_mb} MB file, 4 MB chunks, sha256 checked):")
        mbs: dict[bool, list[float]] = {}
        for _ in range(args.repeats):
            for curve in (False, True):
                mbs.setdefault(curve, []).append(weights_mb_per_s(root, model, curve, args.weights_mb))
        speeds = {curve: statistics.median(values) for curve, values in mbs.items()}
        for curve, speed in speeds.items():
            spread = ", ".join(f"{v:.0f}" for v in mbs[curve])
            print(f"  {'CURVE' if curve else 'plain':<6} {speed:8.1f} MB/s   (runs: {spread})")
        print(f"  CURVE / plain: {speeds[True] / speeds[False]:.2f}")
        verify, step, ratio, external = verifier_share(root, args.run_steps)
        print(f"verifier in a run (configs/local.toml, no warm start, 2 workers, verify_fraction {fraction}):")
        print(
            f"  verify {verify:.3f} s / train {step:.3f} s per step = {ratio:.3f}; outside rollouts per step {external:.0f}"
        )


if __name__ == "__main__":
    main()
