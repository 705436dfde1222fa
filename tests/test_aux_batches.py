"""Replay pairs and SDPO sites in micro-batches within `trainer.micro_batch_tokens`: every unit once,
trimmed of all-padding columns, and the step's gradients those of one batch holding them all."""

from __future__ import annotations

import pytest
import torch

from meshrl.configs import load_config
from meshrl.models.tiny import ensure_tiny, load_tokenizer
from meshrl.traces.collator import TraceCollator
from meshrl.traces.schema import TraceExample
from meshrl.trainer.aux_batches import COLUMNS, aux_micro_batches, unit_counts
from meshrl.trainer.core import TrainerCore

TINY = ["--model.tiny.hidden_size", "32", "--model.tiny.num_layers", "2", "--model.tiny.num_heads", "2"]
CHANNELS = ["--loss.replay.weight", "0.5", "--loss.replay.variant", "dpo", "--loss.sdpo.weight", "1.0"]


def _trace(i: int) -> TraceExample:
    """An episode of `i + 1` failed tool calls, each recovery a different length (so rows differ in width)."""
    turns = [{"role": "user", "content": "Run the tests and fix what fails. " * (1 + i % 3)}]
    for j in range(i + 1):
        turns += [
            {"role": "assistant", "content": f"Running them ({j}).",
             "tool_calls": [{"id": f"c{j}", "name": "bash", "arguments": {"cmd": "pytest -q"}}]},
            {"role": "tool", "content": "bash: pytest: command not found", "tool_call_id": f"c{j}", "is_error": True},
            {"role": "assistant", "content": "pip install pytest first. " * (1 + (i + j) % 4), "tool_error": "command_not_found",
             "error_meta": {"tool_name": "bash", "excerpt": "bash: pytest: command not found"}},
        ]  # fmt: skip
    return TraceExample(trace_id=f"t{i}", source="test", turns=turns, final_reward=0.0)


def _pair(i: int) -> dict:
    return {"state_messages": [{"role": "user", "content": "list the files " * (1 + i)}],
            "chosen": {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "bash", "arguments": {"cmd": "ls"}}]},
            "rejected": {"role": "assistant", "content": "I cannot do that. " * (1 + 2 * i)}}  # fmt: skip


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(ensure_tiny(tmp_path_factory.mktemp("tiny"), load_config(TINY).model.tiny))


@pytest.fixture(scope="module")
def batch(model_path):
    hint = lambda kind, meta: f"Hint: {meta['tool_name']} failed with {kind}; install it first."  # noqa: E731
    collated = TraceCollator(load_tokenizer(model_path), hint_generator=hint)(
        [_trace(i) for i in range(3)], pairs=[_pair(i) for i in range(4)], rl=False
    )
    return collated.batch


def _real(value: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(value, mask)]


@pytest.mark.parametrize("channel", ["dpo_", "sdpo_"])
def test_each_unit_once_within_the_budget_and_no_padding_edge(batch, channel):
    part = {k: v for k, v in batch.items() if k.startswith(channel)}
    budget = 4 * max(part[k].shape[1] for k in part if part[k].dim() == 2)  # about two units a micro-batch
    chunks = aux_micro_batches(channel, part, budget)
    assert len(chunks) > 1
    assert sum(c.count for c in chunks) == int(unit_counts(channel, part).sum()) > 0
    for columns in COLUMNS[channel]:
        for mask_key in columns.masks:
            ids_key = mask_key.replace("attention_mask", "input_ids")
            expected = sorted(_real(part[ids_key], part[mask_key]))
            assert sorted(r for c in chunks for r in _real(c.batch[ids_key], c.batch[mask_key])) == expected
    for chunk in chunks:
        tokens = sum(chunk.batch[m].numel() for columns in COLUMNS[channel] for m in columns.masks)
        assert tokens <= budget or len(chunk.batch[COLUMNS[channel][0].masks[0]]) == 1  # one unit wider alone
        for columns in COLUMNS[channel]:
            occupied = torch.stack([chunk.batch[m] != 0 for m in columns.masks]).any(0)
            assert occupied[:, 0 if columns.left else -1].any()  # the padded side's edge column has a token
        if channel == "sdpo_":  # the loss reads the recovery tokens where the student's align with the teacher's
            on = chunk.batch["sdpo_loss_mask"] == 1
            assert torch.equal(chunk.batch["sdpo_student_input_ids"][on], chunk.batch["sdpo_teacher_input_ids"][on])


def _step(model_path: str, batch: dict, budget: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One step's gradients (taken before the optimizer would apply them) and metrics."""
    core = TrainerCore(load_config([*TINY, *CHANNELS, "--trainer.micro_batch_tokens", str(budget)]), model_path)
    grads: dict[str, torch.Tensor] = {}

    def capture() -> dict[str, float]:
        grads.update({n: p.grad.clone() for n, p in core.model.named_parameters() if p.grad is not None})
        return {}

    core._apply = capture
    return grads, core.train_step([[]], [batch], rl_tokens=0)


def test_micro_batched_channels_give_the_one_batch_gradients_and_metrics(model_path, batch):
    whole, whole_metrics = _step(model_path, batch, budget=1 << 20)
    split, split_metrics = _step(model_path, batch, budget=64)  # every pair and site alone
    assert whole and whole.keys() == split.keys()
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name in ("loss/replay", "loss/sdpo", "sdpo/tokens", "replay/margin", "loss/total"):
        assert split_metrics[name] == pytest.approx(whole_metrics[name], rel=1e-5, abs=1e-7), name
