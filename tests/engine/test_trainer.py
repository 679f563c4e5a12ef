"""Training engine against an independent torch + peft reference, and its isolation guarantees."""

import logging
import re

import jax
import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from tx.engine import train_step as ts
from tx.engine.bank import AdapterBank
from tx.engine.compiles import compile_count
from tx.engine.trainer import Trainer
from tx.lora.layers import LoRASpec
from tx.models.weights import load_model
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, LoraConfig, RequestError

RANK, ALPHA = 4, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def setup(hf_models):
    path, torch_model = hf_models("qwen3", 2, False)
    model, cfg = load_model(str(path), lora=LoRASpec(slots=4, max_rank=8), progress=False)
    return path, torch_model, model, cfg


def random_lora(trainer, run, seed):
    rng = np.random.RandomState(seed)
    params = {p: rng.normal(0, 0.1, v.shape).astype(np.float32) for p, v in trainer.run_params(run).items()}
    trainer.set_run_params(run, params)
    return params


def peft_reference(torch_model, params, cfg):
    import copy

    peft_model = get_peft_model(
        copy.deepcopy(torch_model), PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    )
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for path, value in params.items():
            module, which = ".".join(path[:-1]), "lora_A" if path[-1] == "lora_a" else "lora_B"
            layers = range(cfg.num_layers) if path[1] == "layers" else [None]
            for i in layers:
                name = module if i is None else module.replace("model.layers", f"model.layers.{i}")
                v = value if i is None else value[i]
                named[f"base_model.model.{name}.{which}.default.weight"].copy_(torch.tensor(v.T))
    return peft_model, named


def make_datum(rng, vocab, n, loss):
    tokens = rng.randint(0, vocab, n + 1)
    inputs = {"target_tokens": tokens[1:].astype(np.int64), "weights": rng.uniform(0.2, 1.0, n).astype(np.float32)}
    if loss != "cross_entropy":
        inputs["logprobs"] = rng.uniform(-6, -3, n).astype(np.float32)
        inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = (rng.uniform(size=n) > 0.3).astype(np.float32)
    return Datum(tokens[:-1].tolist(), inputs)


def torch_loss(loss, lp, inputs, config):
    w = torch.tensor(inputs["weights"])
    if loss == "cross_entropy":
        return -(w * lp)
    q, adv = torch.tensor(inputs["logprobs"]), torch.tensor(inputs["advantages"])
    r = torch.exp(lp - q)
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if loss == "importance_sampling":
        per = -r * adv
    elif loss == "ppo":
        per = -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
    elif loss == "cispo":
        per = -torch.clamp(r, lo, hi).detach() * adv * lp
    elif loss == "dro":
        per = -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2)
    elif loss == "gspo":
        m = torch.tensor(inputs["sequence_ratio_mask"]) != 0
        s = torch.exp((lp.detach() - q)[m].mean())
        si = s * torch.exp(lp - lp.detach())
        per = -torch.minimum(si * adv, torch.clamp(si, lo, hi) * adv)
    return per * w


LOSSES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ("dro", {"beta": 0.1}),
    ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}),
]


def test_runs_without_a_seed_start_from_their_own_adapter(setup):
    """Every unseeded run had started from seed 0's A; now each run's id draws its own, and a given seed
    still reproduces its A whatever the run is called."""
    _, _, model, _ = setup
    trainer = Trainer(model, AdapterBank.of(model))

    def a_of(run_id: str, slot: int, seed: int | None) -> np.ndarray:
        run = trainer.create_lora_run(run_id, LoraConfig(rank=4, seed=seed), slot=slot)
        params = trainer.run_params(run)
        a = np.concatenate([np.asarray(v).ravel() for p, v in sorted(params.items()) if "lora_a" in p[-1]])
        trainer.drop_run(run_id)
        return a

    first, second = a_of("x", 1, None), a_of("y", 2, None)
    assert np.abs(first).max() > 0 and not np.array_equal(first, second)
    np.testing.assert_array_equal(a_of("z", 1, 7), a_of("w", 2, 7))


@pytest.mark.parity
def test_every_loss_matches_torch_peft(setup):
    path, torch_model, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("a", LoraConfig(rank=RANK, alpha=ALPHA), slot=1)
    params = random_lora(trainer, run, seed=0)
    rng = np.random.RandomState(1)
    work = [
        ("a", ForwardBackwardRequest([make_datum(rng, cfg.vocab_size, n, name) for n in (9, 14)], name, conf))
        for name, conf in LOSSES
    ]
    results = trainer.forward_backward(work)

    peft_model, named = peft_reference(torch_model, params, cfg)
    total = 0
    for (_, req), result, (name, conf) in zip(work, results, LOSSES, strict=True):
        request_loss = 0
        for datum, out in zip(req.data, result.outputs, strict=True):
            logits = peft_model(torch.tensor([datum.tokens])).logits[0]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])[
                :, 0
            ]
            np.testing.assert_allclose(out["logprobs"], lp.detach().numpy(), atol=1e-4)
            full_conf = {**{"clip_low_threshold": None, "clip_high_threshold": None}, **conf}
            request_loss = request_loss + torch_loss(name, lp, datum.loss_fn_inputs, full_conf).sum()
        assert set(result.metrics) == {"loss:sum"}  # a dense model reports no expert load
        np.testing.assert_allclose(result.metrics["loss:sum"], request_loss.item(), rtol=1e-4, atol=1e-5)
        total = total + request_loss
    total.backward()
    for p, g in run.grads.items():
        which = "lora_A" if p[-1] == "lora_a" else "lora_B"
        module = ".".join(p[:-1])
        for i in range(cfg.num_layers) if p[1] == "layers" else [None]:
            name = module if i is None else module.replace("model.layers", f"model.layers.{i}")
            ref = named[f"base_model.model.{name}.{which}.default.weight"].grad.numpy().T
            ours = np.asarray(g if i is None else g[i])
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def sft_batch(cfg, seed=0, n=6):
    rng = np.random.RandomState(seed)
    return ForwardBackwardRequest(
        [make_datum(rng, cfg.vocab_size, int(rng.randint(5, 30)), "cross_entropy") for _ in range(n)], "cross_entropy"
    )


def test_fused_runs_equal_alone_and_steps_are_isolated(setup):
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    a = trainer.create_lora_run("a", LoraConfig(rank=4, train_unembed=False), slot=1)
    b = trainer.create_lora_run("b", LoraConfig(rank=8, train_attn=False), slot=2)
    random_lora(trainer, a, 3), random_lora(trainer, b, 4)
    req_a, req_b = sft_batch(cfg, 1), sft_batch(cfg, 2)
    fused = trainer.forward_backward([("a", req_a), ("b", req_b)])
    grads_fused = {r: {p: np.asarray(g) for p, g in trainer.runs[r].grads.items()} for r in "ab"}
    for r in "ab":
        trainer.runs[r].grads = {p: g * 0 for p, g in trainer.runs[r].grads.items()}
    alone = [trainer.forward_backward([("a", req_a)])[0], trainer.forward_backward([("b", req_b)])[0]]
    for f, s in zip(fused, alone, strict=True):
        np.testing.assert_allclose(f.metrics["loss:sum"], s.metrics["loss:sum"], rtol=1e-6)
    for r in "ab":
        for p, g in trainer.runs[r].grads.items():
            want = grads_fused[r][p]
            np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=2e-6 * max(1.0, np.abs(want).max()))
    b_params = {p: np.asarray(v) for p, v in trainer.run_params(b).items()}
    b_state = [np.asarray(x) for x in __import__("jax").tree.leaves(b.opt_state)]
    lora_b_slot = {p: np.asarray(v[..., 2, :, :]) for p, v in trainer.bank.arrays.items()}
    trainer.optim_step("a", AdamParams(learning_rate=1e-2, weight_decay=0.5))
    for p, v in trainer.run_params(b).items():
        np.testing.assert_array_equal(np.asarray(v), b_params[p])
    for before, after in zip(b_state, __import__("jax").tree.leaves(b.opt_state), strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))
    for p, v in trainer.bank.arrays.items():
        np.testing.assert_array_equal(np.asarray(v[..., 2, :, :]), lora_b_slot[p])


def test_a_batch_failing_part_way_leaves_the_gradients_as_they_were(setup, monkeypatch):
    """A fused batch that fails after one run's share was accumulated gives every run back its accumulators
    exactly (the runner then runs the requests one by one)."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    trainer.create_lora_run("a", LoraConfig(rank=4, train_unembed=False), slot=1)  # the shapes of the test above
    trainer.create_lora_run("b", LoraConfig(rank=8, train_attn=False), slot=2)
    trainer.forward_backward([("a", sft_batch(cfg, 1))])
    before = {p: np.asarray(g) for p, g in trainer.runs["a"].grads.items()}
    accumulate = ts.accumulate_slot

    def fails_for_b(grads, *args):  # runs accumulate in sorted order: a's share is already added
        if grads is trainer.runs["b"].grads:
            raise RuntimeError("device lost")
        return accumulate(grads, *args)

    monkeypatch.setattr(ts, "accumulate_slot", fails_for_b)
    with pytest.raises(RuntimeError, match="device lost"):
        trainer.forward_backward([("a", sft_batch(cfg, 1)), ("b", sft_batch(cfg, 2))])
    for p, g in trainer.runs["a"].grads.items():
        np.testing.assert_array_equal(np.asarray(g), before[p])


@pytest.mark.parametrize("full", [False, True])
def test_a_long_request_dropped_part_way_leaves_the_gradients_as_they_were(setup, full):
    """The engine drops a long request after some of its micro-batches ran (`LongItem.discard` closes its
    steps): it was reported failed, so what those micro-batches added must not reach the next optim_step."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model), micro_batch_tokens=128)
    run = trainer.create_full_run("a") if full else trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
    trainer.forward_backward([("a", sft_batch(cfg, 3))])
    before = {p: np.asarray(g) for p, g in run.grads.items()}
    assert any(g.any() for g in before.values())
    rng = np.random.RandomState(4)
    long = ForwardBackwardRequest(
        [make_datum(rng, cfg.vocab_size, 100, "cross_entropy") for _ in range(4)], "cross_entropy"
    )
    steps = trainer.forward_backward_steps([("a", long)])
    next(steps), next(steps)  # two micro-batches of 128 tokens added
    steps.close()
    after = {p: np.asarray(g) for p, g in run.grads.items()}
    for p, want in before.items():
        if full:
            assert not after[p].any(), p  # as large as the model: discarded, as a failure part-way says
        else:
            np.testing.assert_array_equal(after[p], want)


def test_a_gradient_that_is_not_finite_is_refused_and_leaves_the_run_as_it_was(setup):
    """Loss weights of 1e38 overflow the gradient to inf: the step is a user error, the run's weights and
    Adam moments stay as they were (not NaN for good), the gradient is dropped, and the next step trains."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("a", LoraConfig(rank=4, train_unembed=False), slot=1)
    random_lora(trainer, run, 5)
    trainer.forward_backward([("a", sft_batch(cfg, 1))])
    trainer.optim_step("a", AdamParams(learning_rate=1e-2))
    params, state = trainer.run_params(run), jax.tree.leaves(run.opt_state)
    params, state = {p: np.asarray(v) for p, v in params.items()}, [np.asarray(x) for x in state]
    huge = sft_batch(cfg, 2)
    for datum in huge.data:
        datum.loss_fn_inputs["weights"] = np.full_like(datum.loss_fn_inputs["weights"], 1e38)
    trainer.forward_backward([("a", huge)])
    with pytest.raises(RequestError, match="not finite") as err:
        trainer.optim_step("a", AdamParams(learning_rate=1e-2))
    assert err.value.category == "user" and run.step == 1
    for p, v in trainer.run_params(run).items():
        np.testing.assert_array_equal(np.asarray(v), params[p])
    for before, after in zip(state, jax.tree.leaves(run.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(after), before)
    assert all(not np.asarray(g).any() for g in run.grads.values())
    trainer.forward_backward([("a", sft_batch(cfg, 3))])
    assert np.isfinite(trainer.optim_step("a", AdamParams(learning_rate=1e-2))["grad_norm:mean"])
    assert all(np.isfinite(np.asarray(v)).all() for v in trainer.run_params(run).values()) and run.step == 2


@pytest.mark.parametrize("poison", ["loss weights", "adapter", "adapter, forward only"])
def test_one_runs_overflow_does_not_reach_another_run_in_the_same_batch(setup, poison):
    """Run a's loss weights of 3e38 (finite, so valid) or its adapter trained to 1e30 overflow a's share of a
    fused batch. The one-hot products that give each slot its gradient met those infs with zeros (0 * inf =
    NaN): b's gradient was NaN and b's optim_step refused. Now b's outputs and gradient are what b alone
    gets, b steps, and only a's step is refused."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    a = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
    b = trainer.create_lora_run("b", LoraConfig(rank=4), slot=2)
    random_lora(trainer, a, 3), random_lora(trainer, b, 4)
    alone = trainer.forward_backward([("b", sft_batch(cfg, 2))])[0]
    grads_alone = {p: np.asarray(g).copy() for p, g in b.grads.items()}
    b.grads = {p: g * 0 for p, g in b.grads.items()}
    req_a = sft_batch(cfg, 1)
    req_a.forward_only = poison.endswith("forward only")  # b is then the only run training
    if poison.startswith("adapter"):
        trainer.set_run_params(a, {p: np.full(v.shape, 1e30, np.float32) for p, v in trainer.run_params(a).items()})
    else:
        for datum in req_a.data:
            datum.loss_fn_inputs["weights"] = np.full_like(datum.loss_fn_inputs["weights"], 3e38)
    fused = trainer.forward_backward([("a", req_a), ("b", sft_batch(cfg, 2))])[1]
    for got, want in zip(fused.outputs, alone.outputs, strict=True):
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-6)
    for p, want in grads_alone.items():
        np.testing.assert_allclose(np.asarray(b.grads[p]), want, rtol=1e-4, atol=1e-7, err_msg=str(p))
    assert np.isfinite(trainer.optim_step("b", AdamParams(learning_rate=1e-2))["grad_norm:mean"])
    if not req_a.forward_only:
        with pytest.raises(RequestError, match="not finite"):
            trainer.optim_step("a", AdamParams(learning_rate=1e-2))


def test_an_update_that_overflows_is_refused_and_leaves_the_run_as_it_was(setup):
    """A finite gradient under weight_decay 1e38 (within float32, so validation lets it through) makes an
    update of inf: the step is a user error naming the adam_params, the run keeps its finite weights and
    moments, and the next step with sane parameters trains."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("a", LoraConfig(rank=4, train_unembed=False), slot=1)
    random_lora(trainer, run, 6)
    params = {p: np.asarray(v) for p, v in trainer.run_params(run).items()}
    trainer.forward_backward([("a", sft_batch(cfg, 1))])
    with pytest.raises(RequestError, match="update is not finite with these adam_params") as err:
        trainer.optim_step("a", AdamParams(learning_rate=10.0, weight_decay=1e38))
    assert err.value.category == "user" and run.step == 0
    for p, v in trainer.run_params(run).items():
        np.testing.assert_array_equal(np.asarray(v), params[p])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(run.opt_state))
    trainer.forward_backward([("a", sft_batch(cfg, 3))])
    trainer.optim_step("a", AdamParams(learning_rate=1e-2))
    assert all(np.isfinite(np.asarray(v)).all() for v in trainer.run_params(run).values()) and run.step == 1


def test_micro_batches_equal_one_batch(setup):
    _, _, model, cfg = setup
    big, small = (
        Trainer(model, AdapterBank.of(model), micro_batch_tokens=1 << 16),
        Trainer(model, AdapterBank.of(model), micro_batch_tokens=128),
    )
    req = sft_batch(cfg, 5, n=12)
    outs = []
    for trainer in (big, small):
        run = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
        random_lora(trainer, run, 7)
        outs.append((trainer.forward_backward([("a", req)])[0], run.grads))
    assert_same_training(*outs[0], *outs[1])


def assert_same_training(r1, g1, r2, g2) -> None:  # type: ignore[no-untyped-def]
    """Two forward_backward results and the gradients they left agree (one batch against its pieces)."""
    np.testing.assert_allclose(r1.metrics["loss:sum"], r2.metrics["loss:sum"], rtol=1e-5)
    for d1, d2 in zip(r1.outputs, r2.outputs, strict=True):
        np.testing.assert_allclose(d1["logprobs"], d2["logprobs"], atol=1e-5)
    for p in g1:
        want = np.asarray(g2[p])
        np.testing.assert_allclose(np.asarray(g1[p]), want, rtol=1e-4, atol=2e-6 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("full", [False, True])
def test_sft_lowers_loss_and_replays_without_compiles(setup, full, caplog):
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    if full:
        trainer.create_full_run("a")
    else:
        trainer.create_lora_run("a", LoraConfig(rank=8), slot=1)
    trainer.await_warm_up()  # the run's small programs were compiled ahead, beside the first step
    req = sft_batch(cfg, 9)
    losses = []
    for step in range(20):
        with jax.log_compiles(step == 0), caplog.at_level(logging.WARNING):
            losses.append(trainer.forward_backward([("a", req)])[0].metrics["loss:sum"])
            trainer.optim_step("a", AdamParams(learning_rate=1e-2 if not full else 5e-3))
        if step == 0:  # the first step compiles the gradient program, not the warmed-up ones; none after it
            compiles = compile_count()
            compiled = re.findall(r"Finished XLA compilation of jit\((\w+)\)", caplog.text)
            assert "_grad" in compiled
            assert not {
                "accumulate_slot",
                "accumulate_full",
                "adam_step",
                "read_slot_params",
                "write_slot_params",
            } & set(compiled), compiled
    assert compile_count() == compiles, "replaying the same workload compiled again"
    assert losses[-1] < 0.5 * losses[0], losses


def test_rematerialised_layers_give_the_same_gradients(setup):
    path, _, model, cfg = setup
    remat_model, _ = load_model(str(path), lora=LoRASpec(slots=4, max_rank=8), remat=True, progress=False)
    req = sft_batch(cfg, 11)
    grads = []
    for m in (model, remat_model):
        trainer = Trainer(m, AdapterBank.of(m))
        run = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
        random_lora(trainer, run, 12)
        trainer.forward_backward([("a", req)])
        grads.append(run.grads)
    for p, g in grads[0].items():
        want = np.asarray(g)
        np.testing.assert_allclose(np.asarray(grads[1][p]), want, rtol=1e-4, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("full", [False, True])
def test_logits_in_blocks_give_the_same_outputs_and_gradients(setup, full):
    """The head in blocks of 2 positions (as a large vocabulary gets; logits recomputed in the backward)
    against all positions at once: same log-probabilities and loss, same gradients for a LoRA run whose
    adapter covers the untied head and for a full fine-tuning run."""
    path, _, model, cfg = setup
    req = sft_batch(cfg, 13)
    results, grads = [], []
    for elements in (ts.LOGIT_ELEMENTS, 2 * cfg.vocab_size * 8):
        trainer = Trainer(model, AdapterBank.of(model))
        trainer.steps = ts.StepFunctions(trainer.steps.graphdef, trainer.steps.roles, elements)
        run = trainer.create_full_run("a") if full else trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
        if not full:
            random_lora(trainer, run, 14)
        results.append(trainer.forward_backward([("a", req)])[0])
        grads.append({p: np.asarray(g) for p, g in run.grads.items()})
    assert any(p[-2:] == ("lm_head", "lora_a") or p[-2:] == ("lm_head", "weight") for p in grads[0]), list(grads[0])
    np.testing.assert_allclose(results[1].metrics["loss:sum"], results[0].metrics["loss:sum"], rtol=1e-6)
    for got, want in zip(results[1].outputs, results[0].outputs, strict=True):
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-5)
    for p, want in grads[0].items():
        np.testing.assert_allclose(grads[1][p], want, rtol=1e-4, atol=2e-6 * max(1.0, np.abs(want).max()))


def test_bf16_full_finetuning_keeps_fp32_moments_and_compiles_once(setup):
    """bfloat16 weights (what `--dtype auto` loads on an accelerator) train with float32 Adam moments and
    hyper-parameters from the first step on; moments born bfloat16 became float32 after one update, so the
    second step compiled `adam_step` again."""
    path = setup[0]
    model, cfg = load_model(str(path), dtype="bfloat16", lora=LoRASpec(slots=4, max_rank=8), progress=False)
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_full_run("a")
    trainer.await_warm_up()
    assert {leaf.dtype for leaf in jax.tree.leaves(run.opt_state) if leaf.dtype.kind == "f"} == {np.dtype("float32")}
    req = sft_batch(cfg, 9)
    compiles = []
    for _ in range(3):
        trainer.forward_backward([("a", req)])
        trainer.optim_step("a", AdamParams(learning_rate=1e-3))
        compiles.append(compile_count())
    assert compiles[1:] == compiles[:1] * 2, "a later step compiled again"
    assert {v.dtype for v in run.params.values()} == {jax.numpy.dtype("bfloat16")}


def test_forward_only_equals_forward_backward_and_leaves_the_gradients(setup):
    """The gradient-free program (`forward`) computes what the gradient program's outputs say."""
    _, _, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
    random_lora(trainer, run, 11)
    rng = np.random.RandomState(12)
    data = [make_datum(rng, cfg.vocab_size, n, "importance_sampling") for n in (7, 12)]
    conf: dict = {}
    forward = trainer.forward_backward([("a", ForwardBackwardRequest(data, "importance_sampling", conf, True))])[0]
    assert all(not np.asarray(g).any() for g in run.grads.values())  # nothing accumulated
    trained = trainer.forward_backward([("a", ForwardBackwardRequest(data, "importance_sampling", conf))])[0]
    assert any(np.asarray(g).any() for g in run.grads.values())
    np.testing.assert_allclose(forward.metrics["loss:sum"], trained.metrics["loss:sum"], rtol=1e-6)
    for f, t in zip(forward.outputs, trained.outputs, strict=True):
        np.testing.assert_allclose(f["logprobs"], t["logprobs"], atol=1e-6)


@pytest.mark.parametrize("full", [False, True])
def test_a_forward_fused_with_training_adds_no_gradient(setup, full):
    """The planner fuses a run's queued forward(X) and forward_backward(Y) into one batch (and another run's
    forward beside them): the gradient is Y's alone, and X is scored as a forward alone scores it. The
    summed loss took X's datums too, so the step trained on X."""
    _, _, model, cfg = setup
    rng = np.random.RandomState(21)
    x = [make_datum(rng, cfg.vocab_size, n, "importance_sampling") for n in (9, 5)]
    y = [make_datum(rng, cfg.vocab_size, n, "importance_sampling") for n in (7, 11)]
    results, grads = [], []
    for fused in (False, True):
        trainer = Trainer(model, AdapterBank.of(model))
        run = trainer.create_full_run("a") if full else trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
        if not full:
            random_lora(trainer, run, 22)
            random_lora(trainer, trainer.create_lora_run("b", LoraConfig(rank=4), slot=2), 23)
        forward = ForwardBackwardRequest(x, "importance_sampling", {}, True)
        train = ForwardBackwardRequest(y, "importance_sampling", {})
        others = [] if full else [("b", ForwardBackwardRequest(x, "cross_entropy", {}, True))]
        if fused:
            results.append(trainer.forward_backward([("a", forward), ("a", train), *others])[:2])
        else:
            results.append([trainer.forward_backward([("a", forward)])[0], trainer.forward_backward([("a", train)])[0]])
        grads.append({p: np.asarray(g) for p, g in run.grads.items()})
    for alone, fused_result in zip(results[0], results[1], strict=True):
        for a, f in zip(alone.outputs, fused_result.outputs, strict=True):
            np.testing.assert_allclose(f["logprobs"], a["logprobs"], atol=1e-5)
            np.testing.assert_allclose(f["elementwise_loss"], a["elementwise_loss"], atol=1e-5)
    for p, want in grads[0].items():
        np.testing.assert_allclose(grads[1][p], want, rtol=1e-4, atol=1e-6, err_msg=str(p))


def test_the_bank_keeps_each_stacks_placement_as_built(setup):
    """A slot's init and clear run programs whose outputs may spell a placement anew (`P(None, None)`
    for `P()`: the same layout, another compile key for every program reading the stacks); the bank holds
    each stack under the sharding it was built with."""
    _, _, model, _ = setup
    bank = AdapterBank.of(model)
    built = {path: x.sharding for path, x in bank.arrays.items()}
    bank.init(1, 4, 8.0, bank.targets(), seed=0)
    bank.clear(1)
    bank.init(2, 4, 8.0, bank.targets(), seed=1)
    assert {path: x.sharding for path, x in bank.arrays.items()} == built
