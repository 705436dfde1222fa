"""DiLoCo islands through torchft: two `meshrl train` islands on loopback (gloo, CPU) and a lighthouse.

One run serves every assertion: island b is SIGKILLed after its first committed outer step with
island a, a goes on alone, b comes back with `--resume`, heals to the global weights and syncs
with a again. Condition-driven (EchoTask's hold file pauses a run at a step boundary): b waits
for its first prompts until a has trained a step, so b cannot run all its steps alone while a
starts, then takes a fixed number of draws and pauses, so it cannot run past the state the test
kills it in (it once finished all its steps before a loaded machine saw that state); a is paused from its first outer step alone until the resumed b has trained a step (its
torchft manager is up), so a cannot finish before b is back, however slow the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")  # the [islands] extra (in [dev], so CI runs these)

from meshrl.trainer.islands import model_fragments, serve_lighthouse

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import e2e
from e2e import ENV, LOSS_SWAPS, MESHRL, REPO, SMALL, assert_loss_swap

STEPS, H = 24, 2
B_DRAWS = 6  # island b's prompt draws before it is killed: steps enough for an outer step and step_2's checkpoint
ISLAND = [*SMALL, "--max-steps", str(STEPS), "--ckpt.interval", "2",
          "--loss.replay.weight", "0", "--loss.sdpo.weight", "0", "--teachers.members", "[]",
          "--trainer.diloco.sync_every", str(H), "--trainer.diloco.host", "localhost",
          "--trainer.diloco.timeout_s", "20", "--trainer.diloco.quorum_timeout_s", "120", *LOSS_SWAPS["mis"]]  # fmt: skip


def records(out: Path) -> list[dict]:
    return e2e.records(out) if (out / "metrics.jsonl").exists() else []


def island(out: Path, name: str, lighthouse: str, *extra: str) -> subprocess.Popen:
    hold = json.dumps({"prompt_delay_s": 0.2, "hold_file": str(out.parent / f"hold_{name}")})
    args = [*MESHRL, "train", *ISLAND, "--output-dir", str(out), "--trainer.diloco.replica_id", name,
            "--trainer.diloco.lighthouse", lighthouse, "--task.kwargs", hold, *extra]  # fmt: skip
    log = (out.parent / f"{name}.log").open("a")
    env = {**ENV, "RUST_LOG": "warn"}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert proc.poll() is None, f"the island ended (rc {proc.returncode}) before {what}"
        time.sleep(0.2)


def test_fragments_partition_the_parameters_once(tiny_lm):
    """Also a Qwen3-shaped model with tied embeddings and grouped-query attention: the tied head
    is one parameter of the first fragment."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tied = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        tie_word_embeddings=True))  # fmt: skip
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    for model in (tiny_lm, tied):
        params = {id(p) for p in model.parameters()}
        for n in (1, 2):
            fragments = model_fragments(model, n)
            ids = [id(p) for f in fragments for p in f.parameters()]
            assert len(ids) == len(set(ids)) and set(ids) == params
        assert id(model.lm_head.weight) in {id(p) for p in model_fragments(model, 2)[0].parameters()}
    with pytest.raises(ValueError, match="trainer.diloco.fragments 3"):
        model_fragments(tiny_lm, 3)


@pytest.mark.mesh
@pytest.mark.network
def test_two_islands_sync_survive_a_death_and_heal_on_resume(tmp_path):
    lighthouse = serve_lighthouse("[::]:0", min_islands=1, join_timeout_ms=10_000, heartbeat_timeout_ms=2_000)
    a_out, b_out = tmp_path / "a", tmp_path / "b"
    (tmp_path / "hold_b").touch()  # b waits for its first prompts until a has trained a step
    a = island(a_out, "a", lighthouse.address())
    b = island(b_out, "b", lighthouse.address())
    try:
        wait_for(lambda: records(a_out), a, "island a's first step")
        (tmp_path / "hold_b").write_text(str(B_DRAWS))  # b takes its first draws, then pauses until killed
        both = lambda rs: [r for r in rs if r.get("diloco/islands") == 2]  # noqa: E731
        wait_for(lambda: both(records(b_out)) and (b_out / "checkpoints" / "step_2" / "COMPLETE").exists(), b,
                 "island b's first outer step with a")  # fmt: skip
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        (tmp_path / "hold_b").unlink()
        killed_at = records(b_out)[-1]["step"]
        # a goes on alone: a later outer step commits with one island; then a waits for b
        wait_for(lambda: any(r.get("diloco/islands") == 1 and r["step"] > killed_at for r in records(a_out)), a,
                 "island a's outer step without b")  # fmt: skip
        (tmp_path / "hold_a").touch()
        b = island(b_out, "b", lighthouse.address(), "--resume")
        # The resumed b's first step has no quorum yet (0 islands); its manager is up from then on.
        wait_for(lambda: any(r["step"] >= 2 and r.get("diloco/islands") == 0 for r in records(b_out)), b,
                 "the resumed island b's first step")  # fmt: skip
        (tmp_path / "hold_a").unlink()
        assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert b.wait(timeout=600) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.shutdown()
    ra, rb = records(a_out), records(b_out)
    assert [r["step"] for r in ra] == list(range(STEPS)) == [r["step"] for r in rb]  # each step once, b resumed
    # one outer step per H steps, but for those an island's death made fail (their update is dropped)
    outer = [r["diloco/outer_steps"] for r in ra]
    assert outer == sorted(outer) and outer[-1] >= STEPS // H - 2
    # Every outer step both islands committed together leaves them the same global weights.
    crc_a = {r["diloco/outer_steps"]: r["diloco/global_crc"] for r in ra if r["diloco/islands"] == 2}
    crc_b = {r["diloco/outer_steps"]: r["diloco/global_crc"] for r in rb if r["diloco/islands"] == 2}
    shared = crc_a.keys() & crc_b.keys()
    assert shared and all(crc_a[s] == crc_b[s] for s in shared)
    # after the resume b rejoined (healed from a) and synced with it again
    assert any(r["step"] > killed_at and r["diloco/islands"] == 2 for r in rb)
    assert_loss_swap(a_out, "mis")  # both islands trained with masked importance sampling
    assert_loss_swap(b_out, "mis")


@pytest.mark.mesh
@pytest.mark.network
def test_lora_islands_sync_their_adapters_alone_through_the_meshes(tmp_path):
    """Two LoRA islands, every outer step with both: the same global adapters after each, and
    each outer step's payload is the adapters' bytes (the base model never travels). Island b
    samples with vLLM's CPU build, which gets the merged weights: on-policy, its sampler agrees
    with its trainer after every update as island a's HF engines (sent the adapters) do."""
    from safetensors.torch import load_file

    lighthouse = serve_lighthouse("[::]:0", min_islands=2, join_timeout_ms=10_000, heartbeat_timeout_ms=2_000)
    lora = ["--model.lora", '{"r": 4, "lora_alpha": 8}', "--max-steps", "6", "--trainer.diloco.min_islands", "2",
            "--model.tiny.hidden_size", "128", "--model.tiny.num_heads", "2", "--generator.max_async_level", "0"]  # fmt: skip
    vllm = ["--generator.backend", "vllm", "--topology.generator.gpus_per_proc", "0"]
    procs = {name: island(tmp_path / name, name, lighthouse.address(), *lora, *(vllm if name == "b" else []))
             for name in "ab"}  # fmt: skip
    try:
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.shutdown()
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in ra] == list(range(6)) == [r["step"] for r in rb]
    assert [r["diloco/outer_steps"] for r in ra][-1] == 6 // H
    crc = lambda rs: {r["diloco/outer_steps"]: r["diloco/global_crc"] for r in rs}  # noqa: E731
    assert crc(ra) == crc(rb)
    adapters = load_file(tmp_path / "a" / "checkpoints" / "step_6" / "adapter" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * 4 for t in adapters.values())  # float32 master weights
    assert ra[-1]["diloco/payload_bytes"] == (6 // H) * adapter_bytes
    kl = {name: [r["mismatch_kl"] for r in rs if "mismatch_kl" in r] for name, rs in (("a", ra), ("b", rb))}
    assert len(kl["a"]) >= 4 and len(kl["b"]) >= 4 and max(kl["a"] + kl["b"]) < 1e-4, kl  # steps that trained RL


@pytest.mark.network  # a lighthouse and torchft's stores on loopback
def test_outer_state_round_trips_through_a_checkpoint(tiny_lm):
    """Streaming DiLoCo (2 fragments) on one island: the outer state a checkpoint holds — global
    weights, outer momentum, the inner-step phase, torchft's step — loads into a fresh island as it was."""
    import torch

    from meshrl.configs.schema import DilocoConfig
    from meshrl.trainer.islands import Islands

    lighthouse = serve_lighthouse("[::]:0", min_islands=1, join_timeout_ms=1_000, heartbeat_timeout_ms=2_000)
    config = DilocoConfig(replica_id="solo", lighthouse=lighthouse.address(), host="localhost", sync_every=4,
                          fragments=2, fragment_sync_delay=1, timeout_s=10, quorum_timeout_s=30,
                          outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)  # fmt: skip
    ids = torch.randint(0, 97, (2, 12))
    try:
        inner = torch.optim.AdamW(tiny_lm.parameters(), lr=1e-2)
        islands = Islands(config, tiny_lm, inner, rank=0, world=1)
        for _ in range(5):  # fragment 0 synced at 2, fragment 1 at 4; one step into the next period
            tiny_lm(ids, labels=ids).loss.backward()
            inner.step()
            inner.zero_grad()
        saved = islands.state()
        assert saved["manager"]["step"] == 2 and saved["local_step"] == 1
        assert islands.metrics()["diloco/islands"] == 1 and islands.stats.payload_bytes > 0
        islands.close()
        fresh = Islands(config, tiny_lm, torch.optim.AdamW(tiny_lm.parameters(), lr=1e-2), rank=0, world=1)
        fresh.load(saved)
        again = fresh.state()
        assert again["manager"] == saved["manager"] and again["local_step"] == 1
        for a, b in zip(again["global"], saved["global"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(o["state"] for o in saved["outer"])  # each fragment's outer step left momentum to keep
        for a, b in zip(again["outer"], saved["outer"], strict=True):
            assert a["state"].keys() == b["state"].keys()
            assert all(
                torch.equal(a["state"][k]["momentum_buffer"], b["state"][k]["momentum_buffer"]) for k in b["state"]
            )
        fresh.close()
    finally:
        lighthouse.shutdown()


def _outer_step(config, models: list, targets: list) -> None:
    """Two islands (threads of this process) move their models' trained parameters to two known
    points in H = 2 inner steps of SGD at lr 1; the H-th inner step runs the outer step."""
    import threading

    import torch

    from meshrl.trainer.islands import Islands

    errors: list[BaseException] = []

    def island(name: str, model, target) -> None:
        try:
            trained = [p for p in model.parameters() if p.requires_grad]
            inner = torch.optim.SGD(trained, lr=1.0)
            islands = Islands(config.model_copy(update={"replica_id": name}), model, inner, rank=0, world=1)
            for p in trained:  # inner step 1: no move
                p.grad = torch.zeros_like(p)
            inner.step()
            for p, t in zip(trained, target, strict=True):  # step 2 lands on the target
                p.grad = p.detach() - t
            inner.step()  # the H-th inner step: the outer step runs in its hook
            model.payload_bytes = islands.stats.payload_bytes
            islands.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=island, args=(n, m, t)) for n, m, t in zip("ab", models, targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors


def _diloco(lighthouse, **overrides):
    from meshrl.configs.schema import DilocoConfig

    return DilocoConfig(lighthouse=lighthouse.address(), host="localhost", sync_every=2, min_islands=2, timeout_s=20,
                        quorum_timeout_s=60, **overrides)  # fmt: skip


@pytest.mark.network  # a lighthouse and torchft's stores on loopback
def test_outer_lr_1_without_momentum_averages_the_islands(tiny_lm):
    """The default outer step (lr 1, momentum 0) is parameter averaging: after it both islands hold
    the mean of the points their local models reached. Nesterov at lr 0.7, momentum 0.9 does not."""
    import copy

    import torch

    torch.manual_seed(0)
    start = [p.detach().clone() for p in tiny_lm.parameters()]
    targets = [[p + torch.randn_like(p) * 0.1 for p in start] for _ in "ab"]
    mean = [(a + b) / 2 for a, b in zip(*targets, strict=True)]
    lighthouse = serve_lighthouse("[::]:0", min_islands=2, join_timeout_ms=5_000, heartbeat_timeout_ms=2_000)
    try:
        averaging = [copy.deepcopy(tiny_lm) for _ in "ab"]
        _outer_step(_diloco(lighthouse), averaging, targets)
        for model in averaging:
            for p, m in zip(model.parameters(), mean, strict=True):
                torch.testing.assert_close(p.detach(), m, rtol=0, atol=1e-6)
        nesterov = [copy.deepcopy(tiny_lm) for _ in "ab"]
        _outer_step(_diloco(lighthouse, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True), nesterov, targets)
        # Nesterov's first step: global - lr * (1 + momentum) * mean pseudo-gradient
        p, s, m = next(nesterov[0].parameters()).detach(), start[0], mean[0]
        torch.testing.assert_close(p, s - 0.7 * 1.9 * (s - m), rtol=0, atol=1e-6)
    finally:
        lighthouse.shutdown()


@pytest.mark.network
def test_lora_islands_average_the_adapters_alone(tiny_lm):
    """With LoRA the islands average the adapters and send nothing else: the frozen base weights
    stay bit for bit, and the outer step's payload is the adapters' bytes."""
    import copy

    import torch

    from meshrl.configs.schema import LoraConfig
    from meshrl.trainer.lora import add_lora

    torch.manual_seed(0)
    models = [copy.deepcopy(tiny_lm) for _ in "ab"]
    for model in models:
        add_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    frozen = {k: v.clone() for k, v in models[0].state_dict().items() if ".lora_" not in k}
    start = [p.detach().clone() for p in models[0].parameters() if p.requires_grad]
    targets = [[p + torch.randn_like(p) * 0.1 for p in start] for _ in "ab"]
    mean = [(a + b) / 2 for a, b in zip(*targets, strict=True)]
    lighthouse = serve_lighthouse("[::]:0", min_islands=2, join_timeout_ms=5_000, heartbeat_timeout_ms=2_000)
    try:
        _outer_step(_diloco(lighthouse), models, targets)
    finally:
        lighthouse.shutdown()
    adapter_bytes = sum(p.numel() * p.element_size() for p in start)
    for model in models:
        trained = [p.detach() for p in model.parameters() if p.requires_grad]
        for p, m in zip(trained, mean, strict=True):
            torch.testing.assert_close(p, m, rtol=0, atol=1e-6)
        for key, value in model.state_dict().items():
            if key in frozen:
                assert torch.equal(value, frozen[key]), key
        assert model.payload_bytes == adapter_bytes
        assert adapter_bytes < 0.1 * sum(v.numel() * v.element_size() for v in frozen.values())


def test_islands_draw_their_own_prompts_from_one_seed():
    """Islands share `seed` (the same model and warm start) but not their prompt and sampling
    streams: two islands on one stream would train on the same rollouts."""
    from meshrl.configs import load_config
    from meshrl.run.streams import stream_seed

    def seed(*args: str) -> int:
        return stream_seed(load_config(["--seed", "3", *args]))

    assert seed() == 3
    a, b = seed("--trainer.diloco.replica_id", "a"), seed("--trainer.diloco.replica_id", "b")
    assert len({3, a, b}) == 3 and a == seed("--trainer.diloco.replica_id", "a")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.diloco.replica_id", "a", "--trainer.parallelism", "fsdp2"], "needs trainer.parallelism = 'ddp'"),
        (["--trainer.diloco.sync_every", "5", "--trainer.diloco.fragments", "2"], "sync_every 5 is not a multiple"),
        (["--trainer.diloco.sync_every", "4", "--trainer.diloco.fragments", "2",
          "--trainer.diloco.fragment_sync_delay", "2"], "fragment_sync_delay 2 must be below"),
    ],
)  # fmt: skip
def test_refused_island_configs(args, message):
    from meshrl.configs import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(args)
