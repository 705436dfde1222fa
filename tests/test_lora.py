"""LoRA adapters (`model.lora`, through peft) in the trainer, on the tiny model and on
SmolLM2-135M-Instruct: only they train, the reference is the base model with them off (exact
against an explicit copy), checkpoints resume exactly (and without adapters, from their merged
weights and reference), generators get the merged weights or the adapters alone, and the export
carries the adapters in peft's format."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from meshrl.configs import load_config
from meshrl.inference.backends import make_engine
from meshrl.loss_adapters.compose import reference_sums
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.run.export import export_model
from meshrl.trainer.core import TrainerCore
from meshrl.trainer.lora import add_lora
from tests.e2e import records, train
from tests.test_trainer import dpo_batch, rl_batch
from tests.test_trainer_core import QWEN_TIED

MERGED_ATOL = 1e-3  # a merged model against the same adapters applied unmerged, float32
LORA = [*QWEN_TIED, "--model.lora", '{"r": 4, "lora_alpha": 8}', "--trainer.lr", "1e-2"]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model_path(request, tmp_path_factory) -> str:
    """The tiny Qwen3-shaped model, and SmolLM2-135M-Instruct as its package ships it."""
    if request.param == "smollm2":
        return str(request.getfixturevalue("smollm2_dir"))
    return str(ensure_tiny(tmp_path_factory.mktemp(request.param) / "model", load_config(QWEN_TIED).model.tiny))


def steps(core: TrainerCore, n: int, seed: int = 0) -> None:
    vocab = core.model.config.vocab_size
    for i in range(n):
        core.train_step([[rl_batch(core.model, seed + i)]], [dpo_batch(seed + i, vocab)], rl_tokens=10)


def test_only_the_adapters_train_and_the_reference_is_the_base_model_exactly(model_path):
    config = load_config([*LORA, "--loss.replay.weight", "0.5", "--loss.replay.variant", "dpo"])
    core = TrainerCore(config, model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    adapters = {n for n, p in core.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert sum(len(g["params"]) for g in core.optimizer.param_groups) == len(adapters)
    assert core.ref_model is None  # no second copy
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    steps(core, 3)
    after = dict(core.model.named_parameters())
    assert all(torch.equal(after[n], before[n]) == (n not in adapters) for n in before)
    batch = dpo_batch(7, core.model.config.vocab_size)
    scored = core._with_reference(batch)
    explicit = reference_sums(base, batch, config.model.logprob_chunk_size)
    for key, value in explicit.items():
        assert torch.equal(scored[key], value), key
    policy = reference_sums(core.model, batch, config.model.logprob_chunk_size)  # the adapters on: not the base
    assert not torch.equal(policy["dpo_ref_chosen_logprob"], explicit["dpo_ref_chosen_logprob"])


def test_adapters_train_in_bf16_over_float32_masters_with_an_exact_reference(model_path):
    """`model.dtype = "bfloat16"`: the adapters stay float32 masters and train under autocast; at the
    start the reference (adapters off) is the policy exactly (B = 0), so DPO's margin is 0."""
    config = load_config([*LORA, "--model.dtype", "bfloat16", "--loss.replay.weight", "0.5"])
    core = TrainerCore(config, model_path)
    vocab = core.model.config.vocab_size
    _, metrics, _ = core._loss(dpo_batch(3, vocab))
    assert metrics["replay/margin"] == 0
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    step = core.train_step([[rl_batch(core.model, 0)]], [dpo_batch(4, vocab)], rl_tokens=10)
    assert step["skipped_steps"] == 0
    moved = {name for name, p in core.model.named_parameters() if not torch.equal(p, before[name])}
    assert all(p.dtype == torch.float32 for p in core.model.parameters())
    # the adapters alone moved: B (A's gradient is B^T·…, 0 while B is 0 on the first step)
    assert moved and all(".lora_B." in name for name in moved)


def test_generators_get_the_merged_weights_and_a_resume_is_exact(model_path, tmp_path):
    config = load_config(LORA)
    core = TrainerCore(config, model_path)
    steps(core, 2)
    merged = core.weights()
    assert not any(".lora_" in n or ".base_layer" in n for n in merged)
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    plain.load_state_dict(merged)
    ids = torch.randint(3, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    core.model.eval()
    with torch.no_grad():  # merged (W + BA) x rounds apart from W x + B A x: ~1e-4 on SmolLM2's logits of ~20
        torch.testing.assert_close(plain(ids).logits, core.model(ids).logits, rtol=0, atol=MERGED_ATOL)
    core.model.train()

    core.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").is_file()
    resumed = TrainerCore(config, model_path)
    resumed.load(tmp_path / "ckpt")
    steps(core, 2, seed=10)
    steps(resumed, 2, seed=10)
    for (name, a), b in zip(core.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name

    out = export_model(tmp_path / "ckpt" / "model", tmp_path / "export", "float32")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), out / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, with_adapter(ids).logits, rtol=0, atol=MERGED_ATOL)


@pytest.mark.parametrize("batching", ["rows", "continuous"])
def test_an_hf_engine_with_the_adapters_injected_takes_them_alone_and_samples_the_trainers_policy(model_path, batching):
    """Either HF engine (its own loop, transformers' continuous batching) with the adapters injected
    takes them alone and samples the trainer's adapted policy: its logprobs are the trainer's."""
    if batching == "continuous" and "smollm2" in model_path:
        pytest.skip("one model shape is enough for the second engine (test time)")
    config = load_config(LORA)
    core = TrainerCore(config, model_path)
    steps(core, 2)
    sent = core.weights(torch.float32, adapters_only=True)
    assert sent and all(".lora_" in name for name in sent)
    engine = make_engine("hf", model_path, "float32", [], hf_batching=batching)
    add_lora(engine.model, config.model.lora).eval()
    engine.load_weights(sent, version=2)
    ids = torch.randint(3, core.model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    core.model.eval()
    with torch.no_grad():
        assert torch.allclose(engine.model(ids).logits, core.model(ids).logits, atol=1e-6)
        plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        assert not torch.allclose(plain(ids).logits, core.model(ids).logits, atol=1e-3)  # the adapters moved it
        turns = engine.generate(ids.tolist(), temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0)
        for turn in turns:
            full_ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
            scored = sequence_token_logprobs(core.model, full_ids)[0, len(turn.prompt_ids) :]
            assert turn.versions == [2] * len(turn.completion_ids)
            torch.testing.assert_close(torch.tensor(turn.logprobs), scored, rtol=0, atol=5e-5)
    engine.close()
    full = core.weights(torch.float32)
    assert sum(v.numel() for v in sent.values()) < 0.2 * sum(v.numel() for v in full.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lora_reference_is_the_policy_rl_starts_from_and_resumes(tmp_path, dtype):
    """After a warm start the reference is a frozen copy of the warm-started adapters: the replay
    margin at the first RL step is 0 (it was 0.0343 with the base as the reference), and a
    checkpoint brings that reference back, not the base."""
    from tests.test_trainer_core import _sft_batch

    config = load_config([*LORA, "--model.dtype", dtype, "--loss.replay.weight", "0.5", "--trainer.warm_start_lr",
                          "0.05"])  # fmt: skip
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    vocab = core.model.config.vocab_size
    for _ in range(5):
        core.sft_step([_sft_batch(core.model)])
    assert core._loss(dpo_batch(3, vocab))[1]["replay/margin"] != 0  # the base is not where RL starts
    core.start_rl()
    assert core._loss(dpo_batch(3, vocab))[1]["replay/margin"] == 0
    core.train_step([[rl_batch(core.model, 0)]], [dpo_batch(4, vocab)], rl_tokens=10)
    core.save(tmp_path / "ckpt")
    resumed = TrainerCore(config, path)
    resumed.load(tmp_path / "ckpt")
    for name, value in core.ref_call.state().items():
        assert torch.equal(resumed.ref_call.state()[name], value), name
    batch = dpo_batch(5, vocab)
    chunk = config.model.logprob_chunk_size
    scored = [c.ref_call(lambda model, b: reference_sums(model, b, chunk), batch) for c in (core, resumed)]
    assert all(torch.equal(scored[0][k], scored[1][k]) for k in scored[0])


def test_a_lora_checkpoint_resumes_without_adapters_from_its_merged_policy_and_reference(tmp_path, capsys):
    """`model.lora` turned off on resume: the policy is the checkpoint's merged weights, AdamW starts
    fresh (its saved state was the adapters') at trainer.lr, not the adapters' (the saved schedule's),
    and the reference is the LoRA run's (the base with the frozen adapters) merged into full weights.
    The load failed: the adapters' optimizer state does not fit full weights."""
    args = [*LORA, "--loss.replay.weight", "0.5"]
    config = load_config(args)
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    lora = TrainerCore(config, path)
    steps(lora, 2)
    lora.start_rl()  # the trained adapters become the reference: it is not the base
    steps(lora, 1, seed=2)
    lora.save(tmp_path / "ckpt")
    full = TrainerCore(load_config([*args, "--model.lora", "null", "--trainer.lr", "1e-4"]), path)
    full.load(tmp_path / "ckpt")
    assert "AdamW starts fresh" in capsys.readouterr().out
    merged, own = lora.weights(torch.float32), full.weights(torch.float32)
    assert merged.keys() == own.keys() and all(torch.equal(own[name], value) for name, value in merged.items())
    batch = dpo_batch(5, full.model.config.vocab_size)
    chunk = config.model.logprob_chunk_size
    lora_ref, full_ref = (c.ref_call(lambda model, b: reference_sums(model, b, chunk), batch) for c in (lora, full))
    base = reference_sums(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch, chunk)
    for key, value in lora_ref.items():
        torch.testing.assert_close(full_ref[key], value, rtol=1e-5, atol=1e-5)  # merged against unmerged
        assert not torch.allclose(base[key], value, rtol=0, atol=1e-3), key
    vocab = full.model.config.vocab_size
    for i in range(2):
        metrics = full.train_step([[rl_batch(full.model, 3 + i)]], [dpo_batch(3 + i, vocab)], rl_tokens=10)
        assert metrics["skipped_steps"] == 0 and metrics["lr"] == 1e-4, metrics
    assert full.scheduler.last_epoch == lora.scheduler.last_epoch + 2


MODULE_KINDS = {
    "linear": (QWEN_TIED, "all-linear"),  # SmolLM2 and the tiny Qwen3: every linear layer
    "experts and router": (["--model.tiny.family", "qwen3_moe", "--model.tiny.num_experts", "4"], "all-linear"),
    "embedding and an untied head": (["--model.tiny.family", "llama"], ["embed_tokens", "q_proj", "lm_head"]),
}


@pytest.mark.parametrize("kind", MODULE_KINDS)
def test_adapters_merged_match_peft_on_every_module_kind(kind, tmp_path):
    """`merged_state` (the trainer's merged weights) and `merge_adapters` with the plan an engine
    holding only the base builds (`lora_plan`: a vLLM generator or worker) give peft's own merge
    (`merge_and_unload`) of every adapted weight: linear layers, fused experts (peft wraps them
    twice), the MoE router, the input embedding, an untied head; the rest stays the base's. peft's
    saved config of the adapters (a checkpoint's adapter/) plans the same."""
    from peft import LoraConfig as PeftLoraConfig

    from meshrl.configs.schema import LoraConfig
    from meshrl.trainer.lora import adapted_weights, adapter_tensors, lora_plan, merge_adapters, merged_state

    shape, targets = MODULE_KINDS[kind]
    path = str(ensure_tiny(tmp_path / "model", load_config(shape).model.tiny))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoraConfig(r=4, lora_alpha=12, target_modules=targets)
    peft_model = add_lora(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_()
    plan = adapted_weights(model)
    assert plan == lora_plan(path, lora)  # what the meta-device build of the same adapters plans
    peft_model.peft_config["default"].save_pretrained(tmp_path / "adapter")  # as a checkpoint's adapter/
    assert plan == lora_plan(path, PeftLoraConfig.from_pretrained(tmp_path / "adapter"))  # lora turned off on resume
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merge_adapters(base, adapter_tensors(state), plan)
    whole = merged_state(state, plan)
    expected = peft_model.merge_and_unload().state_dict()
    adapted = {a.weight for a in plan}
    assert merged.keys() == whole.keys() == expected.keys() == base.keys()
    assert {a.kind for a in plan} == {"linear": {"linear"}, "experts and router": {"linear", "experts"},
                                      "embedding and an untied head": {"linear", "embedding"}}[kind]  # fmt: skip
    for key, value in whole.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-5)
        assert torch.equal(merged[key], value)
        if key in adapted:
            assert not torch.allclose(value, base[key], atol=1e-3), key
        else:
            assert torch.equal(value, base[key]), key


def test_adapters_on_the_embedding_and_the_head_train_score_as_peft_and_resume(tmp_path):
    """The loss reads the head's weight directly (chunked logprobs): an adapted head counts as its
    base weight plus the adapter's delta, so its logprobs are peft's forward's and its adapters train
    (they got no gradient, and a checkpoint of them could not resume: no optimizer state). peft saves
    an embedding's adapters without `.weight` (lora_embedding_A): they map back to the model's own
    names on resume, where they were refused as not fitting model.lora."""
    from meshrl.loss_adapters.logprobs import sequence_token_logprobs

    config = load_config(["--model.tiny.family", "llama", "--model.lora",
                          '{"r": 4, "target_modules": ["embed_tokens", "q_proj", "lm_head"]}', "--trainer.lr", "1e-2"])  # fmt: skip
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    core.train_step([[rl_batch(core.model, 0)]], [None], rl_tokens=10)
    core.train_step([[rl_batch(core.model, 1)]], [None], rl_tokens=10)
    core.save(tmp_path / "ckpt")
    resumed = TrainerCore(config, path)
    resumed.load(tmp_path / "ckpt")
    trained = {n: p for n, p in core.model.named_parameters() if ".lora_" in n}
    assert any("lora_embedding_B" in n and p.abs().sum() > 0 for n, p in trained.items())
    assert trained["lm_head.lora_B.default.weight"].abs().sum() > 0
    for name, value in resumed.model.named_parameters():
        if ".lora_" in name:
            assert torch.equal(value, trained[name]), name
    ids = rl_batch(core.model, 2)["input_ids"]
    with torch.no_grad():
        full = torch.log_softmax(core.model(ids).logits.float(), dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])
        torch.testing.assert_close(sequence_token_logprobs(core.model, ids, 8)[:, 1:], full[..., 0])


def test_the_lora_reference_with_adapter_dropout_is_deterministic(tmp_path):
    """`lora_dropout` is for the policy's training forward: the reference (the frozen adapters, on the
    same model in train mode) scored the same pairs differently on every call."""
    config = load_config([*LORA, "--model.lora", '{"r": 4, "lora_alpha": 8, "lora_dropout": 0.5}',
                          "--loss.replay.weight", "0.5"])  # fmt: skip
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    vocab = core.model.config.vocab_size
    steps(core, 2)
    core.start_rl()  # the trained adapters become the reference: dropout on them would show
    batch = dpo_batch(5, vocab)
    chunk = config.model.logprob_chunk_size
    first, second = (core.ref_call(lambda model, b: reference_sums(model, b, chunk), batch) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert core.model.training  # the policy still trains with its dropout


def test_adapters_on_a_tied_head_are_refused_at_start_up(tmp_path):
    """The tiny Qwen3 ties its head to its input embedding: merged weights could not keep one tensor
    for both, so adapters there are refused before any mesh starts, naming the module."""
    from meshrl.configs.schema import LoraConfig
    from meshrl.trainer.lora import lora_plan

    path = str(ensure_tiny(tmp_path / "model", load_config(QWEN_TIED).model.tiny))
    with pytest.raises(ValueError, match=r"model.embed_tokens \(the head and the input embedding share one tensor"):
        lora_plan(path, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))


@pytest.mark.mesh  # a two-proc Monarch mesh
def test_adapters_on_two_fsdp2_ranks_match_one_rank_and_their_checkpoint_resumes(tmp_path):
    """FSDP2 shards the adapted model: two steps on two ranks (DPO replay on, so the reference with
    the adapters off runs sharded) match one rank holding every batch; the adapters alone and the
    merged weights are gathered whole; the sharded checkpoint resumes on one rank with the same
    adapters and a reference that is still the base model exactly. The adapters sit on the input
    embedding and an untied head too, which the root unit gathers: the root stayed gathered after
    the reference's forward, so the policy's second step ran with the frozen adapters there
    (loss/rl 0.0493 against 0.0521)."""
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env

    from meshrl.actors.trainer import TrainerActor
    from tests.test_trainer import _cat

    lora = ["--model.tiny.family", "llama", "--trainer.lr", "1e-3", "--loss.replay.weight", "0.5",
            "--loss.replay.variant", "dpo", "--model.lora",
            '{"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens", "q_proj", "lm_head"]}']  # fmt: skip
    args = [*lora, "--trainer.parallelism", "fsdp2", "--topology.trainer.procs", "2"]
    model_path = str(ensure_tiny(tmp_path / "tiny", load_config(args).model.tiny))
    config = load_config([*args, "--model.path", model_path])
    single = TrainerCore(config, model_path)
    vocab = single.model.config.vocab_size
    shards = [[rl_batch(single.model, 1), rl_batch(single.model, 2)], [rl_batch(single.model, 3)]]
    aux = [dpo_batch(4, vocab), dpo_batch(8, vocab, pairs=1)]
    rl_tokens = sum(int(b["loss_mask"].sum()) for shard in shards for b in shard)
    expected = [single.train_step([shards[0] + shards[1]], [_cat(aux)], rl_tokens) for _ in range(2)]

    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        setup_torch_elastic_env(procs)
        trainers = procs.spawn("trainer", TrainerActor, config, model_path)
        trainers.setup.call().get()
        got = [list(trainers.train_step.call(shards, aux, rl_tokens).get().values()) for _ in range(2)]
        adapters = list(trainers.policy_weights.call(True).get().values())
        merged = list(trainers.policy_weights.call().get().values())
        trainers.save_checkpoint.call(str(tmp_path / "ckpt")).get()
    finally:
        procs.stop().get()

    for step, want in zip(got, expected, strict=True):
        for name in ("grad_norm", "replay/margin", "loss/rl"):
            assert step[0][name] == step[1][name] == pytest.approx(want[name], rel=1e-4, abs=1e-7), name
    assert adapters[1] is None and merged[1] is None  # only rank 0 ships them
    own = single.weights(torch.float32, adapters_only=True)
    assert adapters[0].keys() == own.keys() and all(".lora_" in name for name in own)
    for name, value in own.items():
        torch.testing.assert_close(adapters[0][name], value, rtol=1e-4, atol=1e-6)
    whole = single.weights(torch.float32)
    assert merged[0].keys() == whole.keys()
    for name, value in whole.items():
        torch.testing.assert_close(merged[0][name], value, rtol=1e-4, atol=1e-6)

    resumed = TrainerCore(load_config([*lora, "--model.path", model_path]), model_path)
    resumed.load(tmp_path / "ckpt")
    for name, value in resumed.weights(torch.float32, adapters_only=True).items():
        assert torch.equal(value, adapters[0][name]), name
    batch = dpo_batch(7, vocab)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    explicit = reference_sums(base, batch, config.model.logprob_chunk_size)
    for key, value in resumed._with_reference(batch).items():
        if key in explicit:
            assert torch.equal(value, explicit[key]), key


@pytest.mark.mesh
def test_a_lora_run_on_the_moe_shape_through_the_meshes_on_two_ddp_ranks_resumes_and_exports(tmp_path):
    """The MoE shape, whose adapters include the fused experts and the router: two DDP trainer ranks
    all-reducing the adapters' gradients, the DPO reference a frozen copy of the adapters,
    generators on the merged weights; a checkpoint, a resume to the end, and `final/adapter/`."""
    out = tmp_path / "run"
    run = ["--model.tiny.family", "qwen3_moe", "--model.tiny.num_experts", "4", "--model.tiny.experts_per_token", "2",
           "--model.lora", '{"r": 4, "lora_alpha": 8}', "--topology.trainer.procs", "2", "--ckpt.interval", "2",
           "--loss.replay.variant", "dpo", "--generator.weight_sync", "filesystem", "--trainer.lr", "1e-2",
           "--generator.max_async_level", "0"]  # fmt: skip
    first = train(out, *run, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step_2" / "adapter" / "adapter_model.safetensors").is_file()
    again = train(out, *run, "--max-steps", "4", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # The generators' HF engines hold the adapters and are sent them alone: they sample the trainer's policy.
    # (on-policy, at lr 1e-2 the adapters move: engines left on older adapters would sample another policy)
    assert all(r["unmasked_mismatch_kl"] < 1e-4 for r in rows if r["unmasked_mismatch_kl"] is not None)
    assert all(r["grad_norm"] > 0 for r in rows[1:]) and any(r.get("loss/replay", 0) != 0 for r in rows)
    assert (out / "final" / "adapter" / "adapter_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(out / "tiny_model", dtype=torch.float32)
    changed = {n for n, p in exported.named_parameters() if not torch.equal(p, base.state_dict()[n])}
    experts = {n for n in changed if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert experts and any(n.endswith("mlp.gate.weight") for n in changed)  # fused experts and router merged
    assert all("proj" in n or n.endswith("mlp.gate.weight") for n in changed)  # the adapted weights, nothing else
