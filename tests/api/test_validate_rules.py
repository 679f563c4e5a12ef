"""Every validation rule at its boundary: the last accepted value passes, the first refused one names its field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from tx import loss_spec
from tx.api import validate
from tx.api.limits import Limits
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, ModelInfo, SampleRequest, SamplingParams

INFO = ModelInfo(base_model="m", vocab_size=100, max_seq_len=16, tokenizer_id="t", max_lora_rank=8)
LIMITS = Limits(max_seq_len=16, vocab_size=100, max_datums=3, max_targets=4, max_stop=2, max_stop_chars=5)


def _ce(tokens: list[int] | None = None, **inputs: Any) -> Datum:
    tokens = tokens if tokens is not None else [1, 2, 3]
    base: dict[str, Any] = {"target_tokens": np.array([2, 3, 4][: len(tokens)] + [0] * (len(tokens) - 3), np.int64)}
    base.update(inputs)
    return Datum(tokens, {k: np.asarray(v) for k, v in base.items() if v is not None})


def _fb(data: list[Datum], loss: str = "cross_entropy", config: dict | None = None) -> None:
    validate.check_forward_backward(ForwardBackwardRequest(data, loss, config or {}), INFO, LIMITS)


def _refused(fragment: str, check: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(validate.ValidationError, match=fragment):
        check(*args, **kwargs)


def test_tokens_at_the_edges_of_vocabulary_and_length() -> None:
    validate.check_tokens([0, 99], INFO, "t")
    validate.check_tokens([1] * 16, INFO, "t")
    _refused("outside the vocabulary", validate.check_tokens, [100], INFO, "t")
    _refused("outside the vocabulary", validate.check_tokens, [-1], INFO, "t")
    _refused("17 tokens, more than the maximum length 16", validate.check_tokens, [1] * 17, INFO, "t")
    _refused("empty", validate.check_tokens, [], INFO, "t")


def test_datum_and_token_counts() -> None:
    _fb([_ce()] * 3)
    _refused("4 datums, more than the limit 3", _fb, [_ce()] * 4)
    _refused("data is empty", _fb, [])
    wide = Limits(max_seq_len=16, vocab_size=100, max_datums=1024)
    assert wide.max_request_tokens == 1024 * 16 and wide.max_tensor_elements == 16 * 64
    assert Limits(max_seq_len=10**6, vocab_size=100).max_request_tokens == 10**6
    assert Limits(max_seq_len=4096, vocab_size=100).max_request_tokens == 1 << 19
    long_info = ModelInfo(base_model="m", vocab_size=100, max_seq_len=1 << 19, tokenizer_id="t")
    long_limits = Limits(max_seq_len=1 << 19, vocab_size=100)
    half = [1] * (1 << 18)
    request = ForwardBackwardRequest([_ce(half), _ce(half)], "cross_entropy", {})
    validate.check_forward_backward(request, long_info, long_limits)  # exactly the request token limit
    request.data.append(_ce([1]))
    _refused("524289 tokens in all", validate.check_forward_backward, request, long_info, long_limits)


def test_loss_names_config_and_required_inputs() -> None:
    _refused("unknown loss_fn 'x'", _fb, [_ce()], "x")
    _refused("loss_fn_config", _fb, [_ce()], "ppo", {"beta": 1.0})
    _refused("missing \\['advantages', 'logprobs'\\]", _fb, [_ce()], "ppo")
    rl = _ce(logprobs=np.zeros(3, np.float32), advantages=np.ones(3, np.float32))
    _fb([rl], "ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 0.5})  # equal bounds are allowed
    gspo = _ce(logprobs=np.zeros(3, np.float32), advantages=np.ones(3), sequence_ratio_mask=np.array([0, 1.0, 1.0]))
    _fb([gspo], "gspo")  # the mask is real-valued, like the other RL inputs
    _refused("missing \\['sequence_ratio_mask'\\]", _fb, [rl], "gspo")


def test_loss_config_defaults() -> None:
    """The defaults a loss runs with when the client sends no loss_fn_config (the protocol's table)."""
    assert loss_spec.validate_loss("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_spec.validate_loss("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert loss_spec.validate_loss("cispo", {"clip_high_threshold": 2}) == {
        "clip_low_threshold": 0.0, "clip_high_threshold": 2.0}  # fmt: skip
    assert loss_spec.validate_loss("dro", None) == {"beta": 0.05}
    assert loss_spec.validate_loss("cross_entropy", None) == {}
    row = loss_spec.config_row("cispo", {"clip_low_threshold": 0.5})
    assert row == [0.5, 4.0, 0.0, 0.0, 0.0]  # columns: clip low, clip high, beta, truncation, kl_coeff


def test_input_shapes_dtypes_and_values() -> None:
    _fb([_ce(extra=np.zeros(3))])  # an input no loss reads: only its length is checked
    _fb([_ce(weights=np.array([0.5, 1.0, 0.0], np.float32))])  # weights are real numbers, not token ids
    _refused("extra has length 2", _fb, [_ce(extra=np.zeros(2))])
    _refused("weights has a scalar", _fb, [_ce(weights=np.float32(1))])
    _refused("advantages has shape", _fb, [_ce(advantages=np.zeros((3, 1), np.float32))])
    _refused("integer token ids", _fb, [_ce(target_tokens=np.zeros(3, np.float32))])
    _refused("NaN or infinite", _fb, [_ce(weights=np.array([1, math.inf, 1], np.float32))])
    _fb([_ce(target_tokens=np.array([0, 99, 0]))])
    _refused("ids outside the vocabulary", _fb, [_ce(target_tokens=np.array([1, 100, 2]))])
    _refused("ids outside the vocabulary", _fb, [_ce(target_tokens=np.array([1, -1, 2]))])
    _refused("weights has shape \\[3\\] but target_tokens has \\[3, 2\\]", _fb,
             [_ce(target_tokens=np.ones((3, 2), np.int64), weights=np.ones(3, np.float32))])  # fmt: skip


def test_top_k_targets() -> None:
    _fb([_ce(target_tokens=np.ones((3, 4), np.int64), weights=np.ones((3, 4), np.float32))])
    _fb([_ce(target_tokens=np.ones((3, 1), np.int64))])
    _refused("K = 5", _fb, [_ce(target_tokens=np.ones((3, 5), np.int64))])
    _refused("K = 0", _fb, [_ce(target_tokens=np.ones((3, 0), np.int64))])
    _refused("takes \\[N\\] or \\[N, K\\]", _fb, [_ce(target_tokens=np.ones((3, 2, 2), np.int64))])
    rl = _ce(target_tokens=np.ones((3, 2), np.int64), logprobs=np.zeros(3, np.float32), advantages=np.ones(3))
    _refused("loss 'ppo' takes \\[N\\]", _fb, [rl], "ppo")


@pytest.mark.parametrize(
    "field, good, bad",
    [
        ("learning_rate", 0.0, -1e-9),
        ("beta1", 0.0, 1.0),
        ("beta2", 0.999, -0.1),
        ("beta2", 0.0, 1.0),
        ("eps", 1e-30, 0.0),
        ("eps", 1e-8, 1e-300),  # 0 in float32: 0 / 0 on a zero gradient
        ("learning_rate", 3e38, 1e300),  # inf in float32
        ("weight_decay", 0.1, 1e39),
        ("grad_clip_norm", 1.0, 1e39),
        ("weight_decay", 0.0, -1e-9),
        ("grad_clip_norm", 0.0, -1.0),
        ("learning_rate", 1.0, math.nan),
        ("eps", 1.0, math.inf),
    ],
)
def test_adam_params(field: str, good: float, bad: float) -> None:
    validate.check_adam(AdamParams(**{field: good}))
    _refused(f"adam_params.{field}", validate.check_adam, AdamParams(**{field: bad}))


def _sample(prompt: list[int] | None = None, n: int = 1, topk: int = 0, **params: Any) -> None:
    merged: dict[str, Any] = {"max_tokens": 1, **params}
    request = SampleRequest(prompt or [1, 2], n, SamplingParams(**merged), "m", topk_prompt_logprobs=topk)
    validate.check_sample(request, INFO, LIMITS, 4, 3)


@pytest.mark.parametrize(
    "field, good, bad",
    [
        ("temperature", 0.0, -1e-9),
        ("temperature", 100.0, math.nan),
        ("top_p", 1.0, 1.0 + 1e-9),
        ("top_p", 1e-9, 0.0),
        ("top_k", -1, -2),
        ("top_k", 0, 101),  # 0 is off, as in transformers and vLLM
        ("top_k", 100, 101),
        ("top_k", 1, -2),
        ("seed", 2**64 - 1, 2**64),
        ("seed", -(2**63), -(2**63) - 1),
        ("max_tokens", 15, 16),  # the prompt's 2 + 15 - 1: the last token drawn takes no position
        ("max_tokens", 1, 0),
    ],
)
def test_sampling_params(field: str, good: Any, bad: Any) -> None:
    _sample(**{field: good})
    _refused(field, _sample, None, 1, 0, **{field: bad})


def test_sample_counts_and_stops() -> None:
    _sample(n=4, topk=3, stop_token_ids=[0, 99])
    _refused("num_samples 5", _sample, None, 5)
    _refused("num_samples 0", _sample, None, 0)
    _refused("topk_prompt_logprobs 4", _sample, None, 1, 4)
    _refused("topk_prompt_logprobs -1", _sample, None, 1, -1)
    small = dataclasses.replace(INFO, vocab_size=2)  # a top-k wider than the vocabulary failed the whole batch
    request = SampleRequest([1, 0], 1, SamplingParams(max_tokens=1), "m", topk_prompt_logprobs=2)
    validate.check_sample(request, small, LIMITS, 4, 3)
    request.topk_prompt_logprobs = 3
    _refused("the model's vocabulary 2", validate.check_sample, request, small, LIMITS, 4, 3)
    _refused("3 entries, more than the limit 2", _sample, None, 1, 0, stop_token_ids=[1], stop_strings=["a", "b"])
    _refused("outside the vocabulary", _sample, None, 1, 0, stop_token_ids=[100])
    _refused("outside the vocabulary", _sample, None, 1, 0, stop_token_ids=[-1])
    _sample(stop_strings=["a", "abcde"])
    _refused("1..5 characters", _sample, None, 1, 0, stop_strings=["abcdef"])
    _refused("1..5 characters", _sample, None, 1, 0, stop_strings=[""])


def test_rank_and_names() -> None:
    validate.check_lora_rank(1, INFO)
    validate.check_lora_rank(8, INFO)
    _refused("rank 9 is outside", validate.check_lora_rank, 9, INFO)
    _refused("rank 0 is outside", validate.check_lora_rank, 0, INFO)
    validate.check_checkpoint_name("a" * 128)
    _refused("path", validate.check_checkpoint_name, "a" * 129)
    _refused("path", validate.check_checkpoint_name, "..")
