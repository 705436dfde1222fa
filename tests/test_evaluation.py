"""Evaluation on the real tiny model: pass@k, held-out prompts, greedy is greedy, checkpoint paths."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from meshrl.inference.hf_engine import HFEngine
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.rollouts.evaluation import EvalPlan, eval_prompts, evaluate, pass_at_k
from meshrl.rollouts.scheduler import Sampling
from meshrl.run.evaluate import model_dir

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from echo_task import EchoTask


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 3, 2) == 1.0


def test_eval_prompts_are_held_out_and_a_split_is_preferred():
    training = EchoTask().sample_prompts(random.Random(0), 8)
    held_out = eval_prompts(EchoTask(), 8, seed=0)
    assert {p.prompt_id for p in held_out}.isdisjoint(p.prompt_id for p in training)
    assert [p.prompt_id for p in eval_prompts(EchoTask(), 8, seed=0)] == [p.prompt_id for p in held_out]

    class WithSplit(EchoTask):
        def eval_prompts(self, rng, n):
            prompts = self.sample_prompts(rng, n)
            for prompt in prompts:
                prompt.prompt_id = f"eval-{prompt.prompt_id}"
            return prompts

    assert all(p.prompt_id.startswith("eval-") for p in eval_prompts(WithSplit(), 3, seed=0))


@pytest.fixture(scope="module")
def engine_and_format(tmp_path_factory):
    path = ensure_tiny(tmp_path_factory.mktemp("eval") / "tiny")
    return HFEngine.from_pretrained(path), EpisodeFormat(AutoTokenizer.from_pretrained(path), EchoTask()), path


def test_evaluate_greedy_and_sampled(engine_and_format):
    engine, episodes, _ = engine_and_format
    prompts = eval_prompts(EchoTask(), 3, seed=0)

    def run(threshold: float, seed: int):
        plan = EvalPlan(prompts, 4, threshold, Sampling(1.0, 1.0, 12), max_episodes=8, max_tokens=10_000, seed=seed)
        return evaluate(engine, episodes, plan)

    first, other_seed = run(0.0, 0), run(2.0, 1)
    assert first.prompts == 3 and first.k == 4
    assert first.reward_greedy == other_seed.reward_greedy  # greedy does not depend on the seed
    assert first.pass_greedy == first.pass_at_1 == first.pass_at_k == 1.0  # every reward >= 0
    assert other_seed.pass_greedy == other_seed.pass_at_1 == other_seed.pass_at_k == 0.0  # none reaches 2
    assert 0.0 <= first.reward_sampled <= 1.0
    assert set(first.metrics()) == {
        "eval/reward_greedy", "eval/reward_sampled", "eval/pass_greedy", "eval/pass@1", "eval/pass@4"}  # fmt: skip


def test_model_dir_takes_a_model_a_checkpoint_or_a_run(engine_and_format, tmp_path):
    *_, path = engine_and_format
    assert model_dir(path) == path
    with pytest.raises(ValueError, match="not a run, checkpoint or HF model directory"):
        model_dir(tmp_path)
    (tmp_path / "config.toml").write_text("")
    with pytest.raises(ValueError, match="no complete checkpoint to evaluate"):
        model_dir(tmp_path)
