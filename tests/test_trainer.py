"""The trainer actor on a real two-proc Monarch mesh (gloo): a DDP or FSDP2 step over two
ranks' shards moves the weights as one rank stepping over all of them; checkpoints round-trip."""

from __future__ import annotations

import pytest
import torch
from monarch.actor import this_host
from monarch.spmd import setup_torch_elastic_env
from transformers import AutoModelForCausalLM

from meshrl.actors.trainer import TrainerActor
from meshrl.configs import load_config
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.core import TrainerCore

pytestmark = pytest.mark.mesh  # a two-proc Monarch mesh

TINY = ["--model.tiny.hidden_size", "32", "--model.tiny.num_layers", "2", "--model.tiny.num_heads", "2"]


def rl_batch(model: torch.nn.Module, seed: int, length: int = 20) -> dict[str, torch.Tensor]:
    """One packed RL micro-batch whose inference logprobs are the model's own (on-policy)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=g)
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[:, length // 2 :] = True
    with torch.no_grad():
        logprobs = sequence_token_logprobs(model, ids, 1024)
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "advantages": torch.randn(1, length, generator=g) * mask,
        "inference_logprobs": logprobs * mask,
    }


def dpo_batch(seed: int, vocab: int, length: int = 12, pairs: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(pairs, length, dtype=torch.bool)
    mask[:, length // 2 :] = True
    return {
        "dpo_chosen_input_ids": torch.randint(3, vocab, (pairs, length), generator=g),
        "dpo_rejected_input_ids": torch.randint(3, vocab, (pairs, length), generator=g),
        "dpo_chosen_response_mask": mask,
        "dpo_rejected_response_mask": mask,
    }


def sdpo_batch(seed: int, vocab: int, recovery: list[int], length: int = 12) -> dict[str, torch.Tensor]:
    """One SDPO row per entry of `recovery` (its recovery turn's token count, at the row's end);
    the teacher rows differ from the student rows in a hint region before it."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randint(3, vocab, (len(recovery), length), generator=g)
    teacher = student.clone()
    teacher[:, 1:4] = torch.randint(3, vocab, (len(recovery), 3), generator=g)
    labels = torch.full((len(recovery), length), -100)
    for row, n in enumerate(recovery):
        labels[row, length - n :] = 1
    return {"sdpo_student_input_ids": student, "sdpo_teacher_input_ids": teacher, "sdpo_loss_mask": labels}


def _cat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_two_rank_step_matches_one_rank_and_checkpoints_round_trip(tmp_path, parallelism):
    args = [
        *TINY,
        "--trainer.parallelism",
        parallelism,
        "--topology.trainer.procs",
        "2",
        "--trainer.lr",
        "1e-3",
        "--loss.replay.weight",
        "0.1",
        "--loss.sdpo.weight",
        "0.2",
        "--trainer.grad_bucket_mb",
        "0.002",
        "--trainer.warmup_steps",
        "4",
        "--metrics.channel_grad_norms",
        "true",
    ]  # fmt: skip - DDP all-reduces in many 2 KB buckets
    config = load_config(args)
    model_path = str(ensure_tiny(tmp_path / "tiny", config.model.tiny, seed=0))
    config = load_config([*args, "--model.path", model_path])

    single = TrainerCore(config, model_path)
    vocab = single.model.config.vocab_size
    warm = [rl_batch(single.model, 5), rl_batch(single.model, 6)]  # one SFT batch per rank
    warm = [{"input_ids": b["input_ids"], "loss_mask": b["loss_mask"]} for b in warm]
    # the warm start runs at its own rate (trainer.lr, warm_start_lr unset), outside the warm-up schedule
    assert single.sft_step([{k: torch.cat([b[k] for b in warm]) for k in warm[0]}])["lr"] == 1e-3
    single.start_rl()  # the DPO reference becomes the warm-started policy
    before = {k: v.clone() for k, v in single.weights().items()}
    # Rank 0 gets two micro-batches, two replay pairs and one SDPO row of 2 recovery tokens; rank 1 one
    # micro-batch, one pair and two SDPO rows of 5 and 3: each channel is the mean over all ranks' pairs
    # and recovery tokens, not the mean of the ranks' means (those gave a cosine of 0.75 to one rank's).
    shards = [[rl_batch(single.model, 1), rl_batch(single.model, 2)], [rl_batch(single.model, 3)]]
    aux = [{**dpo_batch(4, vocab), **sdpo_batch(7, vocab, [2])},
           {**dpo_batch(8, vocab, pairs=1), **sdpo_batch(9, vocab, [5, 3])}]  # fmt: skip
    rl_tokens = sum(int(b["loss_mask"].sum()) for shard in shards for b in shard)
    expected = single.train_step([shards[0] + shards[1]], [_cat(aux)], rl_tokens)
    assert expected["lr"] == pytest.approx(1e-3 / 4)  # the first warm-up step's rate, the one it used

    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        setup_torch_elastic_env(procs)
        trainers = procs.spawn("trainer", TrainerActor, config, model_path)
        trainers.setup.call().get()
        trainers.sft_step.call(warm).get()
        trainers.start_rl.call().get()  # under FSDP2: sharded policy into a sharded reference
        got = list(trainers.train_step.call(shards, aux, rl_tokens).get().values())
        weights = list(trainers.policy_weights.call().get().values())
        trainers.save_checkpoint.call(str(tmp_path / "ckpt")).get()
    finally:
        procs.stop().get()

    assert weights[1] is None  # only rank 0 ships the full weights
    assert got[0]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    # Every rank logs the step's metrics, reduced over all ranks as one rank holding every batch logs
    # them: the channels' means over all pairs and recovery tokens, the RL loss, token fractions over all
    # tokens. SDPO's loss is a JSD of nearly equal distributions (~1e-4): float32 rounding in the step
    # before (which rows share a matmul) shows in it at ~1e-5 relative.
    assert got[0].keys() == got[1].keys() == expected.keys()
    for name, value in expected.items():
        if name not in ("grad_norm", "lr", "skipped_steps", "loss/total"):  # NaN: over no token (none masked)
            assert [g[name] for g in got] == pytest.approx([value] * 2, rel=1e-4, abs=1e-7, nan_ok=True), name
    assert got[0]["sdpo/tokens"] == 10  # recovery tokens of both ranks, summed
    # each channel's part of the gradient over the ranks' mean, as one rank's (DDP averages them
    # itself; FSDP2's shards are reduced already): the loop above compared them
    assert {"grad_norm/rl", "grad_norm/replay", "grad_norm/sdpo"} <= expected.keys()
    after = single.weights()
    for name, value in weights[0].items():
        moved = (after[name] - before[name]).norm()
        assert moved > 0, name
        # Moved alike, up to float noise. In norm, not per element: AdamW's first step moves every element
        # by about lr·sign(gradient), so an element whose gradient is at rounding level can move either way.
        assert (value - after[name]).norm() < 0.05 * moved, name

    resumed = TrainerCore(config, model_path)
    resumed.load(tmp_path / "ckpt")
    for name, value in resumed.weights().items():
        torch.testing.assert_close(value, weights[0][name])
    for name, value in resumed.ref_model.state_dict().items():  # the warm-started policy, not the initial model
        torch.testing.assert_close(value, single.ref_model.state_dict()[name], rtol=1e-4, atol=1e-6)
    assert not torch.equal(
        resumed.ref_model.state_dict()["lm_head.weight"],
        AutoModelForCausalLM.from_pretrained(model_path).lm_head.weight,
    )
    assert len(resumed.optimizer.state) == len(list(resumed.model.parameters()))  # AdamW moments restored
