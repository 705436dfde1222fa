"""What every key of `metrics.jsonl` means: the manual's metrics reference is generated from this
glossary, and the end-to-end tests fail on a logged key it does not explain. `<name>` stands for
one family of keys (a rubric component, a rejection reason, eval's k)."""

from __future__ import annotations

import re
from functools import cache

METRICS: dict[str, dict[str, str]] = {
    "Step": {
        "step": "0-based index of the optimizer step the record describes (of the phase it is in).",
        "phase": "'warm_start' on a warm-start record; absent on RL steps' records.",
        "policy_version": "Policy version this step produced (step + 1); the generators load it next.",
    },
    "Warm start (one record per SFT step, phase warm_start)": {
        "warm_start/loss": "Masked NLL of the demonstrations' assistant tokens, mean over trainer ranks.",
        "warm_start/grad_norm": "Gradient L2 norm before clipping.",
        "warm_start/lr": "Learning rate the SFT step used (trainer.warm_start_lr).",
        "warm_start/seconds": "Wall seconds of the SFT step.",
    },
    "Reward and rollouts": {
        "reward/mean": "Mean reward of the step's fresh (trained-on) rollouts, outside workers' and refills' included; "
        "tied groups that dynamic sampling replaced are out of the batch and out of this mean.",
        "reward/sampled": "With generator.refill_uninformative: mean reward of every fresh rollout sampled for the "
        "step, the replaced tied groups included (the policy's reward, where reward/mean is the batch's).",
        "rollouts": "Fresh rollouts the step used (after stale ones were dropped; refill groups included).",
        "rollouts/cut_off": "Fresh rollouts cut off (finish reason length): their last turn hit generator.max_new_tokens, "
        "or their next turn would not have fit the episode token budget.",
        "rollouts/budget_ended": "Of rollouts/cut_off, those that ended because their next turn would not have fit "
        "the episode token budget (stop condition prompt_too_long), their last turn finished.",
        "rollouts/cut_off_masked": "Cut-off rollouts left out of the RL loss: those whose last turn hit "
        "generator.max_new_tokens (trainer.mask_truncated_completions), and with "
        "trainer.mask_budget_ended_episodes the budget-ended ones.",
        "rollouts/elided": "Fresh rollouts that elided tool results to go on past their budget "
        "(generator.context_policy = 'elide'): each trains as one row per context it was sampled in.",
        "rollouts/external": "Fresh rollouts from outside rollout workers (ingress on).",
        "reward/external": "Mean reward of the outside workers' rollouts (null in metrics.jsonl on a step without any; ingress on).",
        "truncated": "RL rollouts longer than trainer.micro_batch_tokens, cut to that many tokens.",
        "tool_errors": "Tool calls that returned an error, summed over the step's rollouts.",
        "dropped_stale": "Rollouts dropped so far as older than generator.max_off_policy_steps versions (cumulative).",
        "lost_rollouts": "Rollouts lost so far in flight on a generator that died (cumulative).",
        "generator/respawns": "Generator actors replaced after dying or failing since the run (or its resume) started.",
        "generator/errors": "Generator calls that raised so far (cumulative): the rank was replaced and its groups "
        "dealt again once.",
        "staleness": "Mean over sampled tokens of (step − the policy version that sampled the token).",
        "staleness/max": "Largest token staleness of the step, in policy versions.",
        "replay_pairs": "DPO pairs mined from teacher answers since the previous step.",
        "groups/uninformative": "The step's own groups whose rewards were all equal (advantage 0).",
        "groups/refilled": "Extra groups asked for to replace uninformative ones (generator.refill_uninformative); "
        "each one that comes back takes a tied group's place in the batch, as in DAPO.",
        "reasoning/tokens": "Thinking models (a vocabulary with `</think>` as one token): mean sampled tokens "
        "through the first `</think>` over the assistant turns that closed their reasoning: how long the policy "
        "reasons (null on a step where no turn closed it).",
        "reasoning/first_turn_tokens": "Thinking models: the same over episodes' first turns alone, a measure "
        "no change in how many turns episodes take can move.",
        "reasoning/unclosed": "Thinking models: fraction of assistant turns that never closed their reasoning "
        "(cut off while thinking, or no think block at all).",
        "rubric/<component>": "Mean of one reward term of the task's rubric (scoring tasks: verifiers, HumanEval).",
        "task_metric/<metric>": "Mean of an observation the task logs beside its reward (scoring tasks).",
    },
    "Episodes (turns, tool calls, length)": {
        "episode/turns": "Mean assistant turns per fresh rollout.",
        "episode/tool_calls": "Mean tool calls per fresh rollout (the calls its assistant turns made).",
        "episode/tokens": "Mean tokens of a fresh rollout as sampled end to end: its prompt, every sampled turn "
        "and every tool turn, an elided tool result counted at its full size (the length it would have had "
        "without elision).",
        "episode/tokens_max": "The longest fresh rollout's episode/tokens.",
        "episode/elided_tokens": "Mean tokens elision took out of a fresh rollout's context (its elided tool "
        "results less the markers that replaced them; 0 for a rollout that elided nothing): episode/tokens "
        "less this is the mean final context.",
        "episode/version_spread": "Mean over fresh rollouts of (newest − oldest) policy version among its sampled "
        "tokens: how many weight updates landed while it was sampled.",
        "episode/version_spread_max": "The step's largest episode/version_spread.",
        "tool_errors/turn_<bin>": "Tool results that were errors, summed over the step's fresh rollouts, by the "
        "1-based index of the assistant turn whose call they answered, in log2 bins: 1, 2, 3-4, 5-8, 9-16, "
        "17-32, 33+. A bin appears on a step where some rollout made tool calls at a turn in it (0: calls "
        "there, none erred; absent: no calls there).",
        "success/horizon_<h>": "Tasks that set a horizon (prompt info 'horizon', an int: e.g. the tool-call hops "
        "it takes): fraction of the fresh rollouts of horizon h with full reward (≥ 1).",
        "rollouts/horizon_<h>": "Tasks that set a horizon: the fresh rollouts of horizon h the step trained on.",
        "curriculum/horizon": "A curriculum task (the horizon task with start_hops): the horizon the step's prompts "
        "were drawn at, grown from the summaries of the steps generator.max_async_level + 2 or more before it.",
    },
    "Throughput and time": {
        "rollout_tokens_per_s": "Sampled tokens of the fresh rollouts per second of time/generate.",
        "train_tokens_per_s": "RL loss-mask tokens (all ranks) per second of time/train (null on a step that "
        "trained no RL row).",
        "time/step": "Wall seconds of the whole step, from feeding the generators to the record.",
        "time/generate": "Seconds from the step's first group starting to its last group finishing.",
        "time/wait_rollouts": "Seconds the controller waited for (and refilled) rollouts before training.",
        "time/train": "Seconds of the trainer's step on every rank (a DiLoCo outer step included).",
        "time/weight_sync": "Seconds the controller spent publishing the new weights (not the generators' load).",
    },
    "Optimizer": {
        "grad_norm": "Gradient L2 norm before clipping (null in metrics.jsonl on a step skipped for a NaN/Inf gradient).",
        "grad_norm/<channel>": "With metrics.channel_grad_norms: the L2 norm of one loss channel's weighted part of the "
        "gradient (rl, replay, sdpo; before clipping, over the ranks' mean), on steps where the channel had rows: "
        "against grad_norm, how much of the update the channel made.",
        "skipped_steps": "Optimizer steps skipped so far for a NaN/Inf gradient (cumulative).",
        "lr": "Learning rate this step used (a warm-start step's own).",
        "moe/expert_load_max": "Mixture-of-experts policies: the most loaded expert of any layer, its assignments "
        "over its layer's mean per expert (1: even; num_experts: every token on it). The moe/ figures count the "
        "step's RL training tokens on every rank, summed before any ratio: no pad, no reference or SDPO forward, "
        "no FSDP2 zero-weight pass; absent on a step that trained no RL row.",
        "moe/expert_load_min": "Mixture-of-experts policies: the least loaded expert of any layer, as "
        "moe/expert_load_max (0: an expert no token reached).",
        "moe/router_entropy": "Mixture-of-experts policies: mean entropy (nats) of the first layer's router "
        "distribution over the experts, per token of every rank (log num_experts: uniform).",
        "moe/recorded_tokens": "Mixture-of-experts policies whose rollouts carry the sampler's routing "
        "(trainer.routing_replay): the share of the step's RL training tokens with a recorded routing (0 where the "
        "engine records none, as vLLM's CPU build; tool-turn tokens a later turn did not prefill have none).",
        "moe/routing_drift": "With recorded routing: the share of recorded tokens (over every MoE layer) whose top-k "
        "experts under the trainer's own router differ from the sampler's, before replay: how much of the "
        "policy's forward routing replay changes (bf16 sampler numerics, weights steps ahead of the sampler's).",
        "moe/routing_drift/layer_<i>": "moe/routing_drift of MoE layer i alone.",
        "moe/aux_loss": "With trainer.router_aux_loss_coef set: the load-balancing loss of the step's RL passes, "
        "num_experts · Σ_e f_e · P_e over every layer's real tokens, pads out (f_e: expert e's assignments per "
        "token, P_e: its mean router probability); an even load gives experts_per_token.",
    },
    "Losses": {
        "loss/total": "loss/rl + replay weight · loss/replay + SDPO weight · loss/sdpo "
        "(+ trainer.router_aux_loss_coef · moe/aux_loss), over the channels that had rows (null on a step "
        "where none had: no informative rollout, pair or recovery token).",
        "loss/rl": "RL loss per loss-mask token (absent when no rollout had a non-zero advantage).",
        "loss/replay": "Replay channel's DPO or SimPO loss, unweighted (steps with pairs).",
        "loss/sdpo": "SDPO channel's self-distillation loss at tool-error recovery tokens, unweighted.",
        "masked_mismatch_kl": "dppo_kl / ipo: trainer-vs-sampler KL (nats) over the step's tokens the trust region "
        "masked, on every rank (null on a step where it masked none).",
        "unmasked_mismatch_kl": "dppo_kl / ipo: trainer-vs-sampler KL (nats) over the step's tokens that kept their "
        "gradient (null on a step where none did).",
        "is_masked": "dppo_kl / ipo: fraction of loss-mask tokens the trust region masked.",
        "is_masked_low": "dppo_kl: fraction masked because a negative-advantage token's probability fell too far.",
        "is_masked_high": "dppo_kl: fraction masked because a positive-advantage token's probability rose too far.",
        "masked_advantage_positive": "dppo_kl: of the step's masked tokens (every sample and rank), the fraction "
        "with a positive advantage (null on a step where none was masked).",
        "masked_advantage_negative": "dppo_kl: of the step's masked tokens (every sample and rank), the fraction "
        "with a negative advantage (null on a step where none was masked).",
        "ref_kl": "ref_kl: mean (reference − policy) logprob over loss-mask tokens, nats.",
        "ref_kl/masked_mismatch_kl": "ref_kl: trainer-vs-sampler KL (nats) over the step's masked tokens (null "
        "on a step where none was masked).",
        "ref_kl/unmasked_mismatch_kl": "ref_kl: trainer-vs-sampler KL (nats) over the step's kept tokens (null "
        "on a step where none was kept).",
        "ref_kl/is_masked": "ref_kl: fraction of loss-mask tokens masked (probability fell more than mask_low).",
        "tis/capped": "tis: fraction of loss-mask tokens whose importance weight was truncated at cap.",
        "tis/ratio_mean": "tis: mean importance weight over loss-mask tokens, before truncation.",
        "tis/ratio_max": "tis: the step's largest importance weight (over every loss-mask token of every rank).",
        "mis/masked": "mis: fraction of loss-mask tokens whose weight is outside [low, high] (no gradient).",
        "mis/masked_low": "mis: fraction with a weight below low.",
        "mis/masked_high": "mis: fraction with a weight above high.",
        "mis/ratio_mean": "mis: mean importance weight over loss-mask tokens.",
        "mis/ratio_max": "mis: the step's largest importance weight (over every loss-mask token of every rank).",
        "mismatch_kl": "tis / mis: trainer-vs-sampler KL (nats) over all loss-mask tokens.",
        "sdpo/tokens": "Recovery tokens in the step's SDPO rows, over every trainer rank.",
        "replay/<stat>": "Replay channel, means over the step's pairs on every rank: implicit rewards of "
        "chosen and rejected (the rejected row scored through its first id unlike the chosen's), their "
        "margin, accuracy and the chosen NLL.",
    },
    "Collation": {
        "collate/truncated": "Trace rows the collator cut to its max_seq_len.",
        "collate/sdpo_dropped": "SDPO error sites dropped (student and hinted rows did not share recovery tokens).",
        "collate/dpo_dropped": "DPO pairs dropped for exceeding max_seq_len.",
        "collate/dpo_open_reasoning": "DPO pairs left out because the student's sampled turn never closed its "
        "reasoning (thinking formats): no action to contrast, only reasoning against an empty think block.",
    },
    "Teachers": {
        "teacher/actor_failures": "Teacher actors that died mid-round (each respawned; cumulative).",
        "teacher/late_rounds": "Polls that found a teacher round still out (once per step per round).",
        "teacher/mined_pair": "States the teachers answered that gave a replay pair (cumulative).",
        "teacher/mined_student_agrees": "States whose teachers' consensus was the student's own action, by "
        "teachers.agree_by: no pair (cumulative).",
        "teacher/mined_no_consensus": "States with no action min_agree teachers agree on, or a tie for the largest "
        "group: no pair (cumulative).",
        "teacher/mined_no_answer": "States every teacher failed or abstained on (cumulative).",
        "teacher/calls": "Requests made to teacher backends (cache misses within budget; cumulative).",
        "teacher/cache_hits": "Answers served from the on-disk teacher cache (cumulative).",
        "teacher/failures": "Teacher requests that gave no usable action (cumulative).",
        "teacher/skipped_budget": "Requests skipped once teachers.usd_ceiling was reached (cumulative).",
        "teacher/usd_spent": "USD spent on paid teacher endpoints (cumulative).",
    },
    "Evaluation": {
        "eval/reward_greedy": "Mean reward of one greedy episode per eval prompt.",
        "eval/reward_sampled": "Mean reward of eval.k sampled episodes per prompt.",
        "eval/pass_greedy": "Fraction of eval prompts whose greedy episode passes (reward ≥ eval.success_threshold).",
        "eval/pass@<k>": "Unbiased pass@k (reward ≥ eval.success_threshold passes); k = 1 and eval.k.",
        "eval/rubric/<component>": "Rubric term over the sampled eval episodes (scoring tasks).",
        "eval/task_metric/<metric>": "Task metric over the sampled eval episodes (scoring tasks).",
        "eval/policy_version": "The policy version these eval numbers describe (they land when it finishes).",
    },
    "Islands (DiLoCo)": {
        "diloco/outer_steps": "Outer steps committed so far (torchft's step; fragment syncs with Streaming DiLoCo).",
        "diloco/islands": "Islands in the last outer step's quorum (0 before the first).",
        "diloco/pseudo_grad_norm": "L2 norm of the islands' averaged pseudo-gradient at the last outer step.",
        "diloco/payload_bytes": "Pseudo-gradient bytes this rank handed to the outer all-reduce (cumulative).",
        "diloco/global_crc": "Checksum of the global weights: equal on every island after a shared outer step.",
    },
    "Ingress (outside rollout workers)": {
        "ingress/offered": "Groups offered to outside workers (cumulative).",
        "ingress/leased": "Leases handed to workers (cumulative).",
        "ingress/accepted": "Submitted groups that passed verification (cumulative).",
        "ingress/accepted_rollouts": "Rollouts in the accepted groups (cumulative).",
        "ingress/reclaimed": "Offered groups the mesh's generators ran instead (unleased, expired or rejected).",
        "ingress/expired": "Reclaimed groups whose lease expired (ingress.lease_timeout_s).",
        "ingress/late": "Submissions after their lease expired or from before a controller restart.",
        "ingress/refused": "CURVE handshakes refused (key not authorized, or banned).",
        "ingress/errors": "Worker requests whose handling raised an exception.",
        "ingress/weight_bytes_sent": "Bytes of policy weights served to workers.",
        "ingress/rejected/<reason>": "Rejected requests by reason (malformed, replayed, reward_mismatch, "
        "logprob_mismatch, ...).",
        "ingress/workers": "Distinct worker keys seen since this controller started.",
        "ingress/banned_keys": "Worker keys banned after ingress.max_strikes strikes.",
        "ingress/verify_s": "Seconds spent verifying submissions since this controller started.",
        "ingress/verified_tokens": "Sampled tokens re-scored with the claimed policy version.",
    },
}


@cache
def _patterns() -> list[tuple[re.Pattern[str], str]]:
    return [
        (re.compile("".join(".+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<\w+>)", key))
                    + "$"), meaning)
        for group in METRICS.values()
        for key, meaning in group.items()
    ]  # fmt: skip


def meaning(key: str) -> str | None:
    """The glossary's line for a logged key, or None when it has none."""
    return next((text for pattern, text in _patterns() if pattern.match(key)), None)
