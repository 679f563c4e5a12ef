"""The engine serves gpt-oss as it serves the other families, through the real `JaxRunner` from
`build_runner`: a LoRA step on attention and the fused experts, the router's balance as transformers'
router logits give it, the PEFT export loading in peft with the served logprobs, greedy decoding equal to
transformers' `generate` and sampled logprobs equal to teacher forcing, both decoding well past the sliding
window (4) from a prompt longer than it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import GPT_OSS, build_gpt_oss
from drive import run

from tx.engine.runner import JaxRunner
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
)

PROMPT = [3, 14, 15, 92, 65, 35, 8]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[JaxRunner, Any, Any]]:
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    path = tmp_path_factory.mktemp("gpt_oss")
    ref = build_gpt_oss(path)
    runner, info = build_runner(
        EngineConfig(base_model=str(path), data_dir=tmp_path_factory.mktemp("data"), dtype="float32",
            adapters=AdapterConfig(2, 4), sampler=SamplerConfig(max_rows=2, max_seq_len=64))
    )  # fmt: skip
    assert info.arch == "gpt_oss"
    yield runner, ref, path


def max_expert_fraction_of(ref: Any, tokens: list[int]) -> float:
    """From transformers' router logits (gpt-oss picks the top-k logits): the largest share of a layer's
    picks that went to one expert."""
    with torch.no_grad():
        out = ref(torch.tensor([tokens]), output_router_logits=True)
    shares = []
    for logits in out.router_logits:
        picks = torch.topk(logits, GPT_OSS["num_experts_per_tok"], dim=-1).indices.flatten().numpy()
        shares.append(np.bincount(picks, minlength=GPT_OSS["num_local_experts"]).max() / picks.size)
    return float(max(shares))


def test_lora_trains_reports_balance_and_exports_to_peft(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import GptOssForCausalLM

    runner, ref, path = served
    lora = LoraConfig(4, 8.0, seed=3)
    run(runner, "create_model", "run", CreateModelRequest("m", lora))
    tokens = list(range(5, 25))
    datum = Datum(tokens, {"target_tokens": np.array(tokens[1:] + [0], np.int64)})
    first = run(runner, "forward_backward", "run", ForwardBackwardRequest([datum], "cross_entropy"))
    np.testing.assert_allclose(first.metrics["moe/max_expert_fraction:max"], max_expert_fraction_of(ref, tokens))
    for _ in range(2):
        run(runner, "optim_step", "run", OptimStepRequest(AdamParams(learning_rate=1e-2)))
        trained = run(runner, "forward_backward", "run", ForwardBackwardRequest([datum], "cross_entropy"))
    assert -np.sum(trained.outputs[0]["logprobs"]) < -np.sum(first.outputs[0]["logprobs"])
    runner.io.save_peft(tmp_path / "adapter", runner.bank, runner.trainer.runs["run"].slot, lora)
    exported = PeftModel.from_pretrained(GptOssForCausalLM.from_pretrained(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = exported.eval()(torch.tensor([tokens])).logits[0]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])
    np.testing.assert_allclose(trained.outputs[0]["logprobs"], want[:, 0].numpy(), atol=1e-4)


def test_greedy_decoding_equals_transformers_generate(served) -> None:  # type: ignore[no-untyped-def]
    runner, ref, _ = served
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False)
    result = run(runner, "sample", "s", SampleRequest(prompt=PROMPT, num_samples=1, params=params, base_model="m"))
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert result.sequences[0].tokens == want[0, len(PROMPT) :].tolist()


def test_sampled_logprobs_equal_teacher_forcing(served) -> None:  # type: ignore[no-untyped-def]
    runner, ref, _ = served
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop_at_eos=False)
    result = run(runner, "sample", "s", SampleRequest(prompt=PROMPT, num_samples=2, params=params, base_model="m"))
    for seq in result.sequences:
        full = torch.tensor([PROMPT + seq.tokens])
        with torch.no_grad():
            logprobs = torch.log_softmax(ref(full).logits[0, len(PROMPT) - 1 : -1], -1)
        want = logprobs.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(seq.logprobs, want, atol=1e-4)
