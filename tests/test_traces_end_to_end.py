"""Ingest a Claude Code session → mine a replay pair → collate with a locally built chat
tokenizer → composed loss on a tiny model → finite gradients from every live channel."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from meshrl.configs import load_config
from meshrl.configs.schema import TinyModelConfig
from meshrl.loss_adapters import compose_loss
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import build_model, build_tokenizer
from meshrl.traces.claude_code import ingest_claude_code
from meshrl.traces.collator import TraceCollator
from meshrl.traces.pairs import mine_pairs, trace_states

SESSION = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"


def _line(kind: str, uuid: str, parent: str | None, message: dict, **extra) -> str:
    return json.dumps({"type": kind, "uuid": uuid, "parentUuid": parent, "isSidechain": False, "sessionId": SESSION,
                       "timestamp": "2026-11-01T10:00:00Z", "cwd": "/repo", "message": message, **extra})  # fmt: skip


def write_session(path) -> None:
    lines = [
        json.dumps({"type": "summary", "summary": "Fix failing tests", "leafUuid": "u6"}),
        _line("user", "u1", None, {"role": "user", "content": "Run the tests and fix what fails."}),
        _line("assistant", "u2", "u1", {"id": "msg_1", "role": "assistant", "model": "claude",
              "content": [{"type": "thinking", "thinking": "Let me run them.", "signature": "s"}]}),
        _line("assistant", "u3", "u2", {"id": "msg_1", "role": "assistant", "model": "claude",
              "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "pytest -q"}}]}),
        _line("user", "u4", "u3", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
              "content": "bash: pytest: command not found", "is_error": True}]},
              toolUseResult="Error: bash: pytest: command not found"),
        _line("assistant", "u5", "u4", {"id": "msg_2", "role": "assistant", "model": "claude",
              "content": [{"type": "text", "text": "pytest is missing; installing it first."},
                          {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "pip install pytest"}}]}),
        _line("user", "u6", "u5", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
              "content": [{"type": "text", "text": "Successfully installed pytest"}]}]}),
        _line("assistant", "u7", "u6", {"id": "msg_3", "role": "assistant", "model": "claude",
              "content": [{"type": "text", "text": "Installed. All tests pass now."}]}),
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_session_to_gradients(tmp_path):
    session = tmp_path / "project" / f"{SESSION}.jsonl"
    session.parent.mkdir()
    write_session(session)
    (example,) = ingest_claude_code([tmp_path]).examples
    assert any(t.tool_error == "command_not_found" for t in example.turns)
    example = example.model_copy(update={"final_reward": 1.0})

    # two teachers agree the first action should have checked for pytest first
    state = trace_states(example)[0]
    better = {"role": "assistant", "content": "Checking that pytest exists.",
              "tool_calls": [{"id": "t", "name": "Bash", "arguments": {"command": "which pytest"}}]}  # fmt: skip
    pair = mine_pairs(state, {"teacher_a": better, "teacher_b": better, "teacher_c": None}, min_agree=2)
    assert pair is not None and pair.n_teachers_agreeing == 2

    tok = build_tokenizer(512)
    collator = TraceCollator(tok, hint_generator=lambda kind, meta: f"Hint: {meta['tool_name']} hit {kind}.")
    batch = collator([example], pairs=[pair]).batch
    assert {"sdpo_loss_mask", "dpo_chosen_input_ids", "loss_mask"} <= set(batch)

    model = build_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4), tok).double()
    with torch.no_grad():  # on-policy sampler logprobs, slightly perturbed, make the RL channel live
        sampled = sequence_token_logprobs(model, batch["input_ids"], attention_mask=batch["attention_mask"])
    batch["inference_logprobs"] = (sampled + 0.05 * torch.randn_like(sampled)) * batch["loss_mask"]
    batch["advantages"] = batch["advantages"] + batch["loss_mask"] * 0.5  # one trace: give it a non-zero advantage

    config = load_config(["@", str(Path(__file__).parents[1] / "configs" / "local.toml")]).loss
    out = compose_loss(model, batch, config, ref_model=copy.deepcopy(model).eval())
    for channel in ("loss/rl", "loss/replay", "loss/sdpo"):
        assert torch.isfinite(out.metrics[channel]) and out.metrics[channel] != 0, channel
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
