"""What a replay step does to the policy, from a run's checkpoints: the gradient of the replay loss on
the pairs a checkpoint holds (those its next step trains on), with the rejected rows scored through
their first id unlike the chosen row's (as meshrl scores them) and scored whole (as it did before).

    python benchmarks/replay_gradient.py RUN STEP [STEP ...] [--episodes 24]

For each checkpoint RUN/checkpoints/step_STEP it loads the policy, the reference and the pending pairs
(`controller.json`), builds the rows with the run's chat format, and prints for each way of scoring
the rejected rows: the DPO loss and margin (β from the run's config), the gradient norm of the loss
(unweighted: the step's replay gradient is `loss.replay.weight` times it, against the clip norm
`trainer.max_grad_norm`), the norm of the rejected rows' part alone, and the cosine between a descent
step on the loss and the gradient of the log-likelihood of correct episodes (the task's
demonstrations with reward 1, their assistant turns): above 0, the step makes correct episodes more
likely. The task must have demonstrations; float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs.run_record import run_config
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.loss_adapters.replay import dpo_loss
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.rollouts.packing import Encoded
from meshrl.tasks.base import make_task, task_tools
from meshrl.traces.collator import CollateStats, TraceCollator


def scored_logprob(model: torch.nn.Module, row: Encoded) -> torch.Tensor:
    """Summed logprob of a row's masked ids."""
    ids, mask = torch.as_tensor(row.ids)[None], torch.as_tensor(row.mask)[None]
    return sequence_token_logprobs(model, ids, positions=mask).sum()


def whole(row: Encoded) -> Encoded:
    """The row scored from its response's first id to its end (the rule before the divergence cut)."""
    mask = np.zeros_like(row.mask)
    mask[int(np.flatnonzero(row.mask)[0]) :] = True
    return Encoded(row.ids, mask, row.logprobs)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("steps", type=int, nargs="+")
    parser.add_argument("--episodes", type=int, default=24, help="correct demonstrations in the likelihood gradient")
    args = parser.parse_args()
    config = run_config(args.run)  # with the changes its resumes recorded
    task = make_task(config.task)
    chat = ChatSettings.of(config.model)
    tools = task_tools(task)
    beta = config.loss.replay.beta
    for step in args.steps:
        checkpoint = args.run / "checkpoints" / f"step_{step}"
        tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
        collator = TraceCollator(
            tokenizer,
            tools=tools,
            template_kwargs=chat.template_kwargs,
            sampled_format=make_chat(tokenizer, chat, tools),
        )
        policy = AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(checkpoint / "reference", dtype=torch.float32).eval()
        pairs = json.loads((checkpoint / "controller.json").read_text())["pairs"]
        if not pairs:
            print(f"step {step}: no pending pairs")
            continue
        chosen, rejected = collator._dpo(pairs, CollateStats())
        demos = [d for d in task.demonstrations(random.Random(step), 4 * args.episodes) if d.final_reward == 1.0]
        batch = collator(demos[: args.episodes]).batch
        token_logprobs = sequence_token_logprobs(
            policy, batch["input_ids"], positions=batch["loss_mask"], attention_mask=batch["attention_mask"]
        )
        token_logprobs.sum().div(len(demos[: args.episodes])).backward()
        correct = flat_grad(policy)
        for name, rows in (("through divergence", rejected), ("whole", [whole(r) for r in rejected])):
            with torch.no_grad():
                refs = [(scored_logprob(reference, c), scored_logprob(reference, r)) for c, r in zip(chosen, rows)]
            sides = [(scored_logprob(policy, c), scored_logprob(policy, r)) for c, r in zip(chosen, rows)]
            (pc, pr), (rc, rr) = (torch.stack(side) for side in zip(*sides)), (torch.stack(side) for side in zip(*refs))
            loss = dpo_loss(pc, pr, rc, rr, beta=beta).loss
            margins = ((pc - rc) - (pr - rr)).detach()
            loss.backward(retain_graph=True)
            gradient = flat_grad(policy)
            weights = torch.sigmoid(-beta * margins)  # the rejected rows' part of the DPO gradient
            (beta * (weights * pr).mean()).backward()
            rejected_part = flat_grad(policy)
            cosine = F.cosine_similarity(-gradient, correct, dim=0).item()
            print(
                f"step {step}, {len(pairs)} pairs, rejected rows scored {name}: loss {loss.item():.2f}, margin "
                f"{margins.min().item():+.1f} to {margins.max().item():+.1f} nats, |grad| {gradient.norm():.2f} "
                f"(rejected rows' part {rejected_part.norm():.2f}), cosine with correct episodes {cosine:+.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
