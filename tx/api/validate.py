"""Reject bad requests before they are queued, with messages that name the field and the limit.

Checks depend only on `ModelInfo`, the request `Limits` and the loss table in `tx.loss_spec`; the
engine trusts what they passed and checks nothing again. Each function raises `ValidationError`;
the routes turn it into HTTP 400.
"""

from __future__ import annotations

import math

import numpy as np

from tx import loss_spec
from tx.api.limits import Limits
from tx.names import BadName, check_name
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, ModelInfo, SampleRequest


class ValidationError(ValueError):
    """A user error found before queueing."""


def check_tokens(tokens: list[int], info: ModelInfo, where: str) -> None:
    if not tokens:
        raise ValidationError(f"{where} is empty; at least one token is required")
    if len(tokens) > info.max_seq_len:
        raise ValidationError(f"{where} has {len(tokens)} tokens, more than the maximum length {info.max_seq_len}")
    array = np.asarray(tokens)
    bad = np.flatnonzero((array < 0) | (array >= info.vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise ValidationError(
            f"{where}: token id {tokens[pos]} at position {pos} is outside the vocabulary [0, {info.vocab_size})"
        )


def check_forward_backward(request: ForwardBackwardRequest, info: ModelInfo, limits: Limits) -> None:
    loss = request.loss_fn
    if loss not in info.loss_names:
        raise ValidationError(f"unknown loss_fn {loss!r}; supported: {', '.join(info.loss_names)}")
    try:
        loss_spec.validate_loss(loss, dict(request.loss_fn_config))
    except ValueError as err:
        raise ValidationError(f"loss_fn_config: {err}") from err
    if not request.data:
        raise ValidationError("data is empty; at least one datum is required")
    if len(request.data) > limits.max_datums:
        raise ValidationError(f"data has {len(request.data)} datums, more than the limit {limits.max_datums}")
    total = sum(len(d.tokens) for d in request.data)
    if total > limits.max_request_tokens:
        raise ValidationError(f"data has {total} tokens in all, more than the limit {limits.max_request_tokens}")
    for i, datum in enumerate(request.data):
        _check_datum(datum, loss, info, limits, f"data[{i}]")


def _check_datum(datum: Datum, loss: str, info: ModelInfo, limits: Limits, where: str) -> None:
    check_tokens(datum.tokens, info, f"{where}.model_input")
    missing = sorted(set(loss_spec.required_inputs(loss)) - datum.loss_fn_inputs.keys())
    if missing:
        raise ValidationError(f"{where}.loss_fn_inputs is missing {missing} required by loss {loss!r}")
    for name, array in datum.loss_fn_inputs.items():
        _check_input(name, array, len(datum.tokens), loss, limits, f"{where}.loss_fn_inputs.{name}")
    _check_targets(datum, where, info)


def _check_input(name: str, array: np.ndarray, n: int, loss: str, limits: Limits, field: str) -> None:
    """Shape (leading dim = tokens; 2-D only for top-K cross_entropy), dtype and finiteness of one input."""
    if array.ndim == 0 or array.shape[0] != n:
        length = "a scalar" if array.ndim == 0 else f"length {array.shape[0]}"
        raise ValidationError(f"{field} has {length} but model_input has {n} tokens; they must be equal")
    if name not in loss_spec.INPUT_IS_TOKEN_IDS:
        return  # not read by any loss
    top_k = name in loss_spec.TOP_K_INPUTS and loss in loss_spec.TOP_K_LOSSES
    if array.ndim > (2 if top_k else 1):
        allowed = "[N] or [N, K]" if top_k else "[N]"
        raise ValidationError(f"{field} has shape {list(array.shape)}; loss {loss!r} takes {allowed}")
    if array.ndim == 2 and not 1 <= array.shape[1] <= limits.max_targets:
        raise ValidationError(f"{field} has K = {array.shape[1]} targets per token; allowed 1..{limits.max_targets}")
    if loss_spec.INPUT_IS_TOKEN_IDS[name] and not np.issubdtype(array.dtype, np.integer):
        raise ValidationError(f"{field} must hold integer token ids (int64), got {array.dtype}")
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise ValidationError(f"{field} contains NaN or infinite values")


def _check_targets(datum: Datum, where: str, info: ModelInfo) -> None:
    targets = datum.loss_fn_inputs.get("target_tokens")
    if targets is None:
        return
    if (targets < 0).any() or (targets >= info.vocab_size).any():
        raise ValidationError(
            f"{where}.loss_fn_inputs.target_tokens has ids outside the vocabulary [0, {info.vocab_size})"
        )
    weights = datum.loss_fn_inputs.get("weights")
    if weights is not None and weights.shape != targets.shape:
        shapes = f"{list(weights.shape)} but target_tokens has {list(targets.shape)}"
        raise ValidationError(f"{where}.loss_fn_inputs.weights has shape {shapes}")


def check_lora_rank(rank: int, info: ModelInfo) -> None:
    if not 1 <= rank <= info.max_lora_rank:
        raise ValidationError(
            f"lora_config.rank {rank} is outside [1, {info.max_lora_rank}] "
            "(server --max-lora-rank; rank 0 = full fine-tuning)"
        )


FLOAT32_MAX = loss_spec.FLOAT32_MAX  # the optimizer computes in float32: a larger value is inf there
MIN_EPS = 1e-30  # smaller ones round to 0 (or a denormal) in float32, and 0 divides 0 by 0 on a zero gradient


def check_adam(adam: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        if not math.isfinite(getattr(adam, name)):
            raise ValidationError(f"adam_params.{name} must be a finite number, got {getattr(adam, name)}")
    rules = {
        "learning_rate": (0 <= adam.learning_rate <= FLOAT32_MAX, f"in [0, {FLOAT32_MAX:g}]"),
        "beta1": (0.0 <= adam.beta1 < 1.0, "in [0, 1)"),
        "beta2": (0.0 <= adam.beta2 < 1.0, "in [0, 1)"),
        "eps": (MIN_EPS <= adam.eps <= FLOAT32_MAX, f"in [{MIN_EPS:g}, {FLOAT32_MAX:g}]"),
        "weight_decay": (0 <= adam.weight_decay <= FLOAT32_MAX, f"in [0, {FLOAT32_MAX:g}]"),
        "grad_clip_norm": (0 <= adam.grad_clip_norm <= FLOAT32_MAX, f"in [0, {FLOAT32_MAX:g}] (0 = no clipping)"),
    }
    for name, (ok, rule) in rules.items():
        if not ok:
            raise ValidationError(f"adam_params.{name} must be {rule}, got {getattr(adam, name)}")


MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400


def check_ttl(ttl: int | None) -> None:
    """A checkpoint's time to live: absent (never expires) or one hour to ten years."""
    if ttl is not None and not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise ValidationError(f"ttl_seconds {ttl} is outside [{MIN_TTL_S}, {MAX_TTL_S}] (or null: never expires)")


def check_checkpoint_name(name: str, field: str = "path") -> None:
    try:
        check_name(name, field)
    except BadName as err:
        raise ValidationError(str(err)) from err


def check_sample(request: SampleRequest, info: ModelInfo, limits: Limits, max_num_samples: int, max_topk: int) -> None:
    check_tokens(request.prompt, info, "prompt")
    if not 1 <= request.num_samples <= max_num_samples:
        raise ValidationError(f"num_samples {request.num_samples} is outside [1, {max_num_samples}]")
    _check_length(request, info)
    _check_sampling_params(request, info, limits)
    if not 0 <= request.topk_prompt_logprobs <= min(max_topk, info.vocab_size):
        raise ValidationError(
            f"topk_prompt_logprobs {request.topk_prompt_logprobs} is outside [0, {min(max_topk, info.vocab_size)}] "
            f"(the server's limit {max_topk}, the model's vocabulary {info.vocab_size})"
        )
    _check_last_n(request)


def _check_last_n(request: SampleRequest) -> None:
    last_n = request.prompt_logprobs_last_n
    if last_n is None:
        return
    if not (request.prompt_logprobs or request.topk_prompt_logprobs > 0):
        raise ValidationError("prompt_logprobs_last_n needs prompt_logprobs or topk_prompt_logprobs")
    if not 1 <= last_n <= len(request.prompt) - 1:
        raise ValidationError(
            f"prompt_logprobs_last_n {last_n} is outside [1, {len(request.prompt) - 1}] (the prompt's length - 1)"
        )


def _check_length(request: SampleRequest, info: ModelInfo) -> None:
    max_tokens = request.params.max_tokens
    if max_tokens < 1:
        raise ValidationError(f"sampling_params.max_tokens must be >= 1, got {max_tokens}")
    total = len(request.prompt) + max_tokens
    if total - 1 > info.max_seq_len:  # the last token drawn is never fed back: it takes no position
        raise ValidationError(
            f"prompt ({len(request.prompt)} tokens) + sampling_params.max_tokens ({max_tokens}) = {total} "
            f"exceeds the maximum length {info.max_seq_len} by more than the last token, which takes no position"
        )


def _check_sampling_params(request: SampleRequest, info: ModelInfo, limits: Limits) -> None:
    p = request.params
    rules = {
        "temperature": (math.isfinite(p.temperature) and p.temperature >= 0, "a finite number >= 0 (0 = greedy)"),
        "top_p": (math.isfinite(p.top_p) and 0 < p.top_p <= 1, "in (0, 1]"),
        "top_k": (-1 <= p.top_k <= info.vocab_size, f"-1 or 0 (off) or in [1, {info.vocab_size}]"),
        "seed": (p.seed is None or -(1 << 63) <= p.seed < (1 << 64), "a 64-bit integer"),
    }
    for name, (ok, rule) in rules.items():
        if not ok:
            raise ValidationError(f"sampling_params.{name} must be {rule}, got {getattr(p, name)}")
    stops = len(p.stop_token_ids) + len(p.stop_strings)
    if stops > limits.max_stop:
        raise ValidationError(f"sampling_params.stop has {stops} entries, more than the limit {limits.max_stop}")
    if any(not 0 <= t < info.vocab_size for t in p.stop_token_ids):
        raise ValidationError(f"sampling_params.stop has token ids outside the vocabulary [0, {info.vocab_size})")
    if any(not 1 <= len(s) <= limits.max_stop_chars for s in p.stop_strings):
        raise ValidationError(f"sampling_params.stop strings must have 1..{limits.max_stop_chars} characters")
