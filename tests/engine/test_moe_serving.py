"""The engine serves a Qwen3-MoE checkpoint as it serves Qwen3: LoRA training through the real `JaxRunner`
lowers the loss, forward_backward reports the router's balance as transformers' router logits give it, a
full run steps as torch's AdamW does, greedy sampling of the base model equals transformers' `generate` and
sampled logprobs equal teacher forcing; the same for a Qwen3.5-MoE (hub class) where marked."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from drive import run

from tx.engine.runner import JaxRunner
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SampleResult,
    SamplingParams,
    UnloadModelRequest,
    WorkItem,
)

HF = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=128, initializer_range=0.3,
)  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[JaxRunner, Any]]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF)).eval()
    path = tmp_path_factory.mktemp("qwen3_moe")
    ref.save_pretrained(path)
    runner, info = build_runner(
        EngineConfig(base_model=str(path), data_dir=tmp_path_factory.mktemp("data"), dtype="float32",
            adapters=AdapterConfig(3, 4), sampler=SamplerConfig(max_rows=2, max_seq_len=64))
    )  # fmt: skip
    assert info.arch == "qwen3_moe"
    yield runner, ref


def test_lora_training_lowers_the_loss(served) -> None:  # type: ignore[no-untyped-def]
    runner, _ = served
    run(runner, "create_model", "run", CreateModelRequest("m", LoraConfig(4, 8.0, seed=3)))
    tokens = list(range(5, 25))
    datum = Datum(tokens, {"target_tokens": np.array(tokens[1:] + [0], np.int64)})
    losses = []
    for _ in range(3):
        result = run(runner, "forward_backward", "run", ForwardBackwardRequest([datum], "cross_entropy"))
        assert isinstance(result, ForwardBackwardResult)
        losses.append(-float(np.sum(result.outputs[0]["logprobs"])))
        run(runner, "optim_step", "run", OptimStepRequest(AdamParams(learning_rate=1e-2)))
    assert losses[2] < losses[1] < losses[0]


def test_greedy_sampling_equals_transformers_generate(served) -> None:  # type: ignore[no-untyped-def]
    runner, ref = served
    prompt = [3, 14, 15, 92, 65, 35]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_at_eos=False)
    result = run(runner, "sample", "s", SampleRequest(prompt=prompt, num_samples=1, params=params, base_model="m"))
    assert isinstance(result, SampleResult)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert result.sequences[0].tokens == want[0, len(prompt) :].tolist()


def max_expert_fraction_of(ref: Any, datums: list[Datum]) -> float:
    """By hand from transformers' router logits: each layer's top-k picks over the datums' tokens, the largest
    share of a layer's picks that went to one expert."""
    counts = np.zeros((HF["num_hidden_layers"], HF["num_experts"]))
    for datum in datums:
        with torch.no_grad():
            out = ref(torch.tensor([datum.tokens]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            picks = torch.topk(torch.softmax(logits, -1), HF["num_experts_per_tok"], dim=-1).indices
            counts[layer] += np.bincount(picks.flatten().numpy(), minlength=HF["num_experts"])
    return float((counts / counts.sum(axis=1, keepdims=True)).max())


def test_forward_backward_reports_the_routers_load_balance(served) -> None:  # type: ignore[no-untyped-def]
    """Two requests fused into one round, each over its own tokens (rows padded: padding never counts)."""
    runner, ref = served
    run(runner, "create_model", "balance", CreateModelRequest("m", LoraConfig(4, 8.0, seed=1)))
    rng = np.random.RandomState(2)
    requests = []
    for lengths in ((7, 13), (5,)):
        data = [Datum(t, {"target_tokens": np.array(t[1:] + [0], np.int64)}) for t in
                (rng.randint(0, HF["vocab_size"], n).tolist() for n in lengths)]  # fmt: skip
        requests.append(ForwardBackwardRequest(data, "cross_entropy"))
    items = [WorkItem(f"b{i}", "forward_backward", "balance", r, created_at=0.0) for i, r in enumerate(requests)]
    runner.submit(items)
    results = {c.future_id: c.result for c in runner.step()}
    for item, request in zip(items, requests, strict=True):
        got = results[item.future_id].metrics["moe/max_expert_fraction:max"]
        assert 1 / HF["num_experts"] <= got <= 1 / HF["num_experts_per_tok"]
        np.testing.assert_allclose(got, max_expert_fraction_of(ref, request.data), rtol=1e-6)


@pytest.fixture(scope="module")
def served_qwen3_5_moe(tmp_path_factory) -> Iterator[tuple[JaxRunner, Any]]:
    from models.test_qwen3_5_moe import build

    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    path = tmp_path_factory.mktemp("qwen3_5_moe")
    ref = build(path, multimodal=True)
    runner, info = build_runner(
        EngineConfig(base_model=str(path), data_dir=tmp_path_factory.mktemp("data35"), dtype="float32",
            adapters=AdapterConfig(2, 4), sampler=SamplerConfig(max_rows=2, max_seq_len=64))
    )  # fmt: skip
    assert info.arch == "qwen3_5_moe"
    yield runner, ref, path


def test_qwen3_5_moe_trains_exports_reports_balance_and_samples_as_generate(served_qwen3_5_moe, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A LoRA step moves every target; the PEFT export (experts fused) loads in peft with the served logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runner, ref, path = served_qwen3_5_moe
    lora = LoraConfig(4, 8.0, seed=3)
    run(runner, "create_model", "run", CreateModelRequest("m", lora))
    tokens = list(range(5, 25))
    datum = Datum(tokens, {"target_tokens": np.array(tokens[1:] + [0], np.int64)})
    result = run(runner, "forward_backward", "run", ForwardBackwardRequest([datum], "cross_entropy"))
    assert 1 / 4 <= result.metrics["moe/max_expert_fraction:max"] <= 1 / 2
    run(runner, "optim_step", "run", OptimStepRequest(AdamParams(learning_rate=1e-2)))
    trained = run(runner, "forward_backward", "run", ForwardBackwardRequest([datum], "cross_entropy"))
    runner.io.save_peft(tmp_path / "adapter", runner.bank, runner.trainer.runs["run"].slot, lora)
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = exported.eval()(torch.tensor([tokens])).logits[0]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])
    np.testing.assert_allclose(trained.outputs[0]["logprobs"], want[:, 0].numpy(), atol=1e-4)
    # ... and reads back into another slot as the same adapter (the fused experts split per expert again).
    assert runner.io.peft_lora_config(tmp_path / "adapter") == dataclasses.replace(lora, seed=None)
    slot, spare = runner.trainer.runs["run"].slot, runner.bank.allocate("reload", "sampler", 4, 8.0).slot
    runner.io.load_peft(tmp_path / "adapter", runner.bank, spare)
    read = [runner.bank.read_peft(s, 4, runner.bank.targets(), runner.io.cfg.stacked_layer) for s in (slot, spare)]
    assert read[0].keys() == read[1].keys() and runner.bank.scale[spare].tolist() == runner.bank.scale[slot].tolist()
    for name, (a, b) in read[0].items():
        np.testing.assert_allclose(read[1][name][0], a, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(read[1][name][1], b, rtol=1e-6, err_msg=name)
    runner.bank.clear(spare)
    runner.bank.release("reload")
    prompt = [3, 14, 15, 92, 65, 35]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_at_eos=False)
    sampled = run(runner, "sample", "s", SampleRequest(prompt=prompt, num_samples=1, params=params, base_model="m"))
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert sampled.sequences[0].tokens == want[0, len(prompt) :].tolist()


def test_an_expert_parallel_engine_computes_what_one_device_does(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """EngineConfig.expert_parallel_size (--expert-parallel-size) splits each block's experts over devices."""
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    one, _ = served
    config = EngineConfig(base_model=one.io.base_model, data_dir=tmp_path, dtype="float32", expert_parallel_size=2,
        adapters=AdapterConfig(3, 4), sampler=SamplerConfig(max_rows=2, max_seq_len=64))  # fmt: skip
    split, _ = build_runner(config, model_dir=one.io.model_dir)
    experts = next(v for p, v in split.trainer.base.items() if "experts" in p and v.ndim >= 3)
    assert "expert" in str(experts.sharding.spec)  # each device holds half of the experts
    tokens = list(range(3, 19))
    datum = Datum(tokens, {"target_tokens": np.array(tokens[1:] + [0], np.int64)})
    outs = []
    for runner in (one, split):
        run(runner, "create_model", "ep", CreateModelRequest("m", LoraConfig(4, 8.0, seed=5)))
        outs.append(run(runner, "forward", "ep", ForwardBackwardRequest([datum], "cross_entropy", forward_only=True)))
        run(runner, "unload_model", "ep", UnloadModelRequest())
    np.testing.assert_allclose(outs[1].outputs[0]["logprobs"], outs[0].outputs[0]["logprobs"], atol=1e-5)


@pytest.mark.parametrize("fixture", ["served", "served_qwen3_5_moe"])
def test_sampled_logprobs_equal_teacher_forcing(fixture, request) -> None:  # type: ignore[no-untyped-def]
    """Two samples at temperature 1 from one prompt: each token's logprob is transformers' on the whole sequence."""
    runner, ref = request.getfixturevalue(fixture)[:2]
    prompt = [3, 14, 15, 92, 65, 35]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, stop_at_eos=False)
    result = run(runner, "sample", "s", SampleRequest(prompt=prompt, num_samples=2, params=params, base_model="m"))
    assert result.sequences[0].tokens != result.sequences[1].tokens  # two draws, not one sequence twice
    for seq in result.sequences:
        with torch.no_grad():
            logprobs = torch.log_softmax(ref(torch.tensor([prompt + seq.tokens])).logits[0, len(prompt) - 1 : -1], -1)
        want = logprobs.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(seq.logprobs, want, atol=1e-4)


def test_full_fine_tuning_steps_as_torch_adamw(served) -> None:  # type: ignore[no-untyped-def]
    """A full run trains every weight (router and experts too): after one forward_backward and optim_step its
    logprobs are those of the transformers model after torch's AdamW step on the same cross-entropy sum."""
    import copy

    runner, ref = served
    run(runner, "create_model", "full", CreateModelRequest("m", None))
    tokens = list(range(5, 25))
    targets = torch.tensor(tokens[1:] + [0])[:, None]
    datum = Datum(tokens, {"target_tokens": targets[:, 0].numpy().astype(np.int64)})
    adam = AdamParams(learning_rate=1e-2, eps=1e-3, weight_decay=0.1)
    first = run(runner, "forward_backward", "full", ForwardBackwardRequest([datum], "cross_entropy"))
    run(runner, "optim_step", "full", OptimStepRequest(adam))
    after = run(runner, "forward", "full", ForwardBackwardRequest([datum], "cross_entropy", forward_only=True))
    run(runner, "unload_model", "full", UnloadModelRequest())
    model = copy.deepcopy(ref)
    logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1).gather(-1, targets)[:, 0]
    np.testing.assert_allclose(first.outputs[0]["logprobs"], logprobs.detach().numpy(), atol=1e-4)
    (-logprobs.sum()).backward()
    betas = (adam.beta1, adam.beta2)
    torch.optim.AdamW(model.parameters(), adam.learning_rate, betas, adam.eps, adam.weight_decay).step()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1).gather(-1, targets)[:, 0]
    assert np.abs(want.numpy() - logprobs.detach().numpy()).max() > 1e-2  # the step moved the model
    np.testing.assert_allclose(after.outputs[0]["logprobs"], want.numpy(), atol=1e-4)
