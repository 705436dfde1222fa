"""How far SDPO's hint moves its teacher, and where: the error sites of a task's demonstrations.

    python benchmarks/sdpo_hint.py RUN [RUN ...] [--demos 8] [--seed 11] [--top 6]

The task's demonstrations that recover from a failed tool call (the code exercises with `run_python`:
a bugged run fails, the next turn runs the reference), collated into SDPO's rows as the trainer gets
them (the run's chat format, the task's hint before the recovery turn), both rows through each run's
exported policy (RUN/final, float32 on the CPU), and at each recovery token the channel's own
per-token divergence (`generalized_jsd` at the run's `loss.sdpo` settings). Prints the mean, the
share of tokens the hint moves at all, and the positions where it moves the first RUN's policy most,
with the student's and the teacher's top tokens; later RUNs are read at those same positions, so a
trained policy shows whether its training moved the hint-free student where the hinted teacher of
the first pointed. The mean over a recovery turn is small where most of its tokens copy what came
before: the hint matters at the few tokens where the fix differs from the bug.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs.run_record import run_config
from meshrl.configs.schema import RunConfig
from meshrl.loss_adapters.compose import sdpo_targets
from meshrl.loss_adapters.sdpo import generalized_jsd
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.tasks.base import make_task, task_tools
from meshrl.traces.collator import TraceCollator


class Sites(NamedTuple):
    """A policy's view of the demonstrations' recovery tokens: student and teacher log-probabilities
    (N, V), the tokens (N), and each position's context text."""

    student: torch.Tensor
    teacher: torch.Tensor
    tokens: torch.Tensor
    contexts: list[str]


def site_distributions(run: Path, config: RunConfig, tokenizer: AutoTokenizer, demos: int, seed: int) -> Sites:
    """The run's exported policy at the seeded demonstrations' error sites, in SDPO's rows."""
    task = make_task(config.task)
    tools = task_tools(task)
    chat = ChatSettings.of(config.model)
    collator = TraceCollator(
        tokenizer,
        hint_generator=task.hint,
        tools=tools,
        template_kwargs=chat.template_kwargs,
        sampled_format=make_chat(tokenizer, chat, tools),
    )
    episodes = [d for d in task.demonstrations(random.Random(seed), 8 * demos) if any(t.tool_error for t in d.turns)]
    batch = collator(episodes[:demos]).batch
    targets = sdpo_targets(batch)
    policy = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
    sides = []
    with torch.no_grad():
        for side in ("student", "teacher"):
            ids, mask = batch[f"sdpo_{side}_input_ids"], batch[f"sdpo_{side}_attention_mask"]
            sides.append(torch.log_softmax(policy(input_ids=ids, attention_mask=mask).logits[:, :-1], -1)[targets])
    ids = batch["sdpo_student_input_ids"]
    contexts = [tokenizer.decode(ids[r, max(0, c - 12) : c + 1]) for r, c in torch.nonzero(targets).tolist()]
    return Sites(sides[0], sides[1], ids[:, 1:][targets], contexts)


def top(tokenizer: AutoTokenizer, logprobs: torch.Tensor) -> str:
    """The three likeliest tokens and their probabilities."""
    best = logprobs.exp().topk(3)
    return ", ".join(f"{tokenizer.decode([i])!r} {p:.2f}" for p, i in zip(best.values.tolist(), best.indices.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--demos", type=int, default=8, help="demonstrations with an error site")
    parser.add_argument("--seed", type=int, default=11, help="the demonstrations' draw")
    parser.add_argument("--top", type=int, default=6, help="positions shown, where the first run's hint moves most")
    args = parser.parse_args()
    first = positions = None
    for run in args.runs:
        config = run_config(run)
        tokenizer = AutoTokenizer.from_pretrained(run / "final")
        student, teacher, tokens, contexts = site_distributions(run, config, tokenizer, args.demos, args.seed)
        sdpo = config.loss.sdpo
        jsd = torch.stack([
            generalized_jsd(s[None], t[None], beta=sdpo.jsd_beta, temperature=sdpo.temperature) for s, t in zip(student, teacher)
        ])  # fmt: skip
        if first is None:
            first, positions = tokens, jsd.topk(min(args.top, jsd.numel())).indices
        elif not torch.equal(tokens, first):  # another task or chat format: its positions are not the first run's
            raise SystemExit(f"{run}: its recovery tokens differ from {args.runs[0]}'s; compare runs of one task")
        print(
            f"{run}: {tokens.numel()} recovery tokens; JSD a token {jsd.mean():.4f} (max {jsd.max():.3f}), "
            f"above 0.01 at {(jsd > 0.01).float().mean():.1%}; top tokens differ at "
            f"{(student.argmax(-1) != teacher.argmax(-1)).float().mean():.1%}"
        )
        for i in positions.tolist():
            print(
                f"  JSD {jsd[i]:.3f} after {contexts[i][-48:]!r}: student {top(tokenizer, student[i])}; "
                f"teacher {top(tokenizer, teacher[i])}"
            )


if __name__ == "__main__":
    main()
