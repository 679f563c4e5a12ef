"""`optim_step` and full fine-tuning gradients against torch, step by step, through the real `Trainer`.

The reference is a transformers model (wrapped by `peft` for a LoRA run) holding the same weights,
trained by `torch.optim.AdamW` after `torch.nn.utils.clip_grad_norm_` on the gradient of the same
cross-entropy loss computed by torch autograd. Each step changes the hyper-parameters, as a client may,
so betas, eps, weight decay, the learning rate and clipping all act; the server's reported `grad_norm`
must be torch's pre-clip norm. Gradients are compared with torch's, then torch steps on the engine's
gradient, so the optimizer is compared on identical inputs.
"""

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from tx.engine.bank import AdapterBank
from tx.engine.trainer import Trainer
from tx.lora.layers import LoRASpec
from tx.models.weights import load_model
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, LoraConfig

RANK, ALPHA = 4, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# eps is large enough to matter next to these gradients; clipping acts on step 1 and leaks into the
# moments of later steps; step 2 sets a bound above the norm (no clip), step 3 none at all.
STEPS = [
    AdamParams(learning_rate=2e-2, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1),
    AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1, grad_clip_norm=0.05),
    AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.3, grad_clip_norm=1e4),
    AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.0),
]


@pytest.fixture(scope="module")
def setup(hf_models):
    path, torch_model = hf_models("qwen3", 2, False)
    model, cfg = load_model(str(path), lora=LoRASpec(slots=2, max_rank=8), progress=False)
    return torch_model, model, cfg


def hf_name(path: tuple[str, ...], layer: int | None) -> str:
    """('model', 'layers', 'mlp', 'up_proj', 'weight'), 1 -> 'model.layers.1.mlp.up_proj.weight'."""
    name = ".".join(path)
    return name if layer is None else name.replace("model.layers", f"model.layers.{layer}")


def pairs(flat: dict, named: dict, lora: bool, num_layers: int) -> list[tuple[tuple, int | None, torch.Tensor]]:
    """(engine path, layer or None, the torch parameter holding that layer's slice) for every trained weight."""
    out = []
    for path in sorted(flat):
        for layer in range(num_layers) if path[1] == "layers" else [None]:
            if lora:
                which = "lora_A" if path[-1] == "lora_a" else "lora_B"
                key = f"base_model.model.{hf_name(path[:-1], layer)}.{which}.default.weight"
            else:
                key = hf_name(path, layer)
            out.append((path, layer, named[key]))
    return out


def engine_value(flat: dict, path: tuple, layer: int | None, lora: bool) -> np.ndarray:
    value = np.asarray(flat[path] if layer is None else flat[path][layer])
    return value.T if lora else value  # adapters are stored [in, R] / [R, out]; torch holds [R, in] / [out, R]


def batch(vocab: int, seed: int) -> ForwardBackwardRequest:
    rng = np.random.RandomState(seed)
    data = []
    for n in (7, 12, 5):
        tokens = rng.randint(0, vocab, n + 1)
        weights = rng.uniform(0.2, 1.0, n).astype(np.float32)
        data.append(Datum(tokens[:-1].tolist(), {"target_tokens": tokens[1:].astype(np.int64), "weights": weights}))
    return ForwardBackwardRequest(data, "cross_entropy")


def torch_loss(model: torch.nn.Module, req: ForwardBackwardRequest) -> torch.Tensor:
    total = torch.zeros(())
    for d in req.data:
        logits = model(torch.tensor([d.tokens])).logits[0]
        target = torch.tensor(d.loss_fn_inputs["target_tokens"])[:, None]
        lp = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
        total = total - (torch.tensor(d.loss_fn_inputs["weights"]) * lp).sum()
    return total


def make_run(trainer: Trainer, torch_model: torch.nn.Module, full: bool):
    """The engine run and its torch twin (same weights) with the list of trained torch parameters."""
    if full:
        run = trainer.create_full_run("a")
        reference = copy.deepcopy(torch_model)
        return run, reference, pairs(run.params, dict(reference.named_parameters()), False, trainer.config.num_layers)
    run = trainer.create_lora_run("a", LoraConfig(rank=RANK, alpha=ALPHA), slot=1)
    rng = np.random.RandomState(0)  # B != 0, so every adapter weight has a gradient from step 0
    params = {p: rng.normal(0, 0.1, v.shape).astype(np.float32) for p, v in trainer.run_params(run).items()}
    trainer.set_run_params(run, params)
    peft_cfg = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    reference = get_peft_model(copy.deepcopy(torch_model), peft_cfg)
    trained = pairs(params, dict(reference.named_parameters()), True, trainer.config.num_layers)
    with torch.no_grad():
        for path, layer, tensor in trained:
            tensor.copy_(torch.tensor(engine_value(params, path, layer, True)))
    return run, reference, trained


@pytest.mark.parity
@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_optim_steps_match_torch_adamw(setup, full):
    torch_model, model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run, reference, trained = make_run(trainer, torch_model, full)
    tensors = [t for _, _, t in trained]
    first = STEPS[0]
    opt = torch.optim.AdamW(tensors, lr=first.learning_rate, betas=(first.beta1, first.beta2), eps=first.eps)
    clipped = []
    for step, adam in enumerate(STEPS):
        req = batch(cfg.vocab_size, step)
        result = trainer.forward_backward([("a", req)])[0]
        loss = torch_loss(reference, req)
        np.testing.assert_allclose(result.metrics["loss:sum"], loss.item(), rtol=1e-5)
        loss.backward()
        for path, layer, tensor in trained:  # the engine's accumulated gradient before the step
            ref = tensor.grad.numpy()
            ours = engine_value(run.grads, path, layer, not full)
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=str(path))
            # From here torch steps on the engine's gradient: near-zero entries would otherwise amplify
            # float32 noise by up to lr / eps, and the optimizer is compared on identical inputs.
            tensor.grad.copy_(torch.tensor(ours))
        bound = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(tensors, bound).item()
        clipped.append(norm > bound)
        for group in opt.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps)
            group["weight_decay"] = adam.weight_decay
        opt.step()
        opt.zero_grad()
        metrics = trainer.optim_step("a", adam)
        np.testing.assert_allclose(metrics["grad_norm:mean"], norm, rtol=1e-5)
        params = trainer.run_params(run)
        for path, layer, tensor in trained:
            ref = tensor.detach().numpy()
            ours = engine_value(params, path, layer, not full)
            # updates are ~lr; a wrong hyper-parameter moves weights by more than 1e-2 * lr
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * adam.learning_rate, err_msg=f"step {step} {path}")
        for g in run.grads.values():  # optim_step starts the next accumulation from zero
            assert not np.asarray(g).any()
    assert clipped == [False, True, False, False], "the steps must exercise clipping as the comment says"
