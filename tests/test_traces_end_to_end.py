"""Ingest a Claude Code session → mine a replay pair → collate with a locally built chat
tokenizer → composed loss on a tiny model → finite gradients from every live channel."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from meshrl.configs import load_config
from meshrl.configs.schema import TaskConfig, TinyModelConfig
from meshrl.inference.completion import Completion
from meshrl.loss_adapters import compose_loss
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import build_model, build_tokenizer
from meshrl.rollouts.batches import rollout_trace
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.tasks.base import make_task, task_tools
from meshrl.traces.claude_code import ingest_claude_code
from meshrl.traces.collator import TraceCollator
from meshrl.traces.errors import ErrorClassifier
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


def test_replay_and_sdpo_rows_from_a_rollout_hold_its_sampled_ids():
    """A rollout's recovery turn samples a malformed call (a parse→render would rewrite it as a
    `<malformed>` call the policy never wrote): the rejected DPO row and both SDPO rows hold the
    sampled ids exactly, after the rollout's own ids before the turn (student and rejected rows)."""
    tok = build_tokenizer(512, chat_template="hermes")
    task = make_task(TaskConfig(kwargs={"n_keys": 3}))
    episode = EpisodeFormat(tok, task)
    (prompt,) = task.sample_prompts(random.Random(0), 1)

    def sample(rollout, text: str) -> tuple[list[int], list[int]]:
        """The ids before the turn and the turn's sampled ids; the turn's calls are answered."""
        before, ids = list(rollout.token_ids), tok(text + episode.footer, add_special_tokens=False)["input_ids"]
        calls = episode.add_turn(rollout, Completion(before, ids, [-0.5] * len(ids), "stop", [0] * len(ids)))
        episode.add_tool_results(rollout, calls, [episode.call_tool(rollout, c) for c in calls])
        return before, ids

    rollout = episode.start(prompt)
    sample(rollout, '<tool_call>\n{"name": "lookup", "arguments": {"key": "nowhere"}}\n</tool_call>')  # an error
    malformed = '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"\n</tool_call>'
    before, recovery = sample(rollout, malformed)  # the error site: its call is malformed (an error too)
    rollout.reward = 0.0
    assert rollout.tool_errors == 2 and rollout.messages[4]["tool_calls"][0]["function"]["name"] == "<malformed>"
    # a mixture of experts' routing as the sampler recorded it (every position but the last)
    rollout.routing = (np.arange((len(rollout.token_ids) - 1) * 4).reshape(-1, 2, 2) % 7).astype(np.uint8)

    example = rollout_trace(rollout, ErrorClassifier())
    state = trace_states(example)[1]
    assert state.prompt_token_ids == before and state.student_token_ids == recovery
    better = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "t", "name": "lookup", "arguments": {"key": "a"}}],
    }
    pair = mine_pairs(state, {"a": better, "b": better}, min_agree=2)
    assert pair is not None and pair.rejected_token_ids == recovery

    collator = TraceCollator(tok, hint_generator=lambda kind, meta: "Hint: the key is a.", tools=task_tools(task))
    batch = collator([example], pairs=[pair], rl=False).batch

    def row(ids, mask) -> tuple[list[int], list[int]]:  # (unmasked ids before the response, masked ids)
        ids, mask = ids[ids != tok.pad_token_id].tolist(), mask[ids != tok.pad_token_id].bool().tolist()
        return [i for i, m in zip(ids, mask) if not m], [i for i, m in zip(ids, mask) if m]

    chosen_before, chosen = row(batch["dpo_chosen_input_ids"][0], batch["dpo_chosen_response_mask"][0])
    assert chosen_before == before and tok.decode(chosen).startswith("<tool_call>")  # the teachers' call, rendered
    # the malformed call is scored through its first id unlike the teachers' call; the row holds it whole
    differs = next(i for i, (a, b) in enumerate(zip(recovery, chosen)) if a != b)
    rejected_ids, rejected_mask = batch["dpo_rejected_input_ids"][0], batch["dpo_rejected_response_mask"][0].bool()
    assert rejected_ids[rejected_ids != tok.pad_token_id].tolist() == before + recovery
    assert rejected_ids[rejected_mask].tolist() == recovery[: differs + 1]
    sdpo_mask = batch["sdpo_loss_mask"][0] == 1
    assert row(batch["sdpo_student_input_ids"][0], sdpo_mask) == (before, recovery)
    hinted, teacher_ids = row(batch["sdpo_teacher_input_ids"][0], sdpo_mask)
    assert teacher_ids == recovery and "Hint: the key is a." in tok.decode(hinted)
    # SDPO's student row is the episode's prefix, left-padded: it replays the episode's routing; the
    # teacher's hinted row routes itself (no record)
    routed, n = batch["sdpo_student_routed_experts"][0], len(before) + len(recovery)
    assert torch.equal(routed[-n:], torch.from_numpy(rollout.routing[:n])) and bool((routed[:-n] == 255).all())
    assert "sdpo_teacher_routed_experts" not in batch and "dpo_chosen_routed_experts" not in batch
    # ids a trace brings are not trusted: one outside the vocabulary is refused, naming the trace
    forged = pair.model_copy(update={"rejected_token_ids": [*recovery, len(tok)]})
    with pytest.raises(ValueError, match=f"trace {pair.trace_id} turn 4: token ids outside the vocabulary"):
        collator([], pairs=[forged], rl=False)


def test_an_ingested_session_s_flood_is_capped_and_states_past_the_budget_are_left_out(tmp_path, capsys):
    """A session whose tool printed ~100k tokens: at load its tool results are capped as an
    episode's, and a state whose context leaves no room for a reply is left out, the trace named."""
    from meshrl.run.controller import Controller

    session = tmp_path / "project" / f"{SESSION}.jsonl"
    session.parent.mkdir()
    write_session(session)
    (example,) = ingest_claude_code([tmp_path]).examples
    flood = random.Random(0).randbytes(60_000).hex()
    turns = [t.model_copy(update={"content": t.content + flood}) if t.role == "tool" else t for t in example.turns]
    traces = tmp_path / "traces.jsonl"
    traces.write_text(example.model_copy(update={"turns": turns}).to_json() + "\n")
    args = ["@", str(Path(__file__).parents[1] / "configs" / "local.toml"), "--output-dir", str(tmp_path / "run"),
            "--task.traces", json.dumps([str(traces)]), "--generator.max-tool-result-tokens", "128",
            "--trainer.micro-batch-tokens", "384"]  # fmt: skip
    controller = Controller(load_config(args))
    states = controller.offline_states
    tokenizer = controller.tokenizer
    results = [m["content"] for s in states for m in s.state_messages if m["role"] == "tool"]
    assert results and all(len(tokenizer.encode(r, add_special_tokens=False)) <= 128 for r in results)
    assert 0 < len(states) < len(trace_states(example))  # the last states' contexts no longer fit
    assert f"(trace {example.trace_id}): " in capsys.readouterr().out
