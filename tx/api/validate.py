"""Reject bad requests before they are queued, with messages that name the field and the limit.

Checks depend only on `ModelInfo` (vocabulary size, maximum sequence length, maximum LoRA rank,
served losses) and the loss tables in `tx.protocol`. Each function raises `ValidationError`; the
routes turn it into HTTP 400.
"""

from __future__ import annotations

import re

import numpy as np

from tx.engine import losses
from tx.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    ModelInfo,
    SampleRequest,
)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,255}$")


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


def check_forward_backward(request: ForwardBackwardRequest, info: ModelInfo) -> None:
    loss = request.loss_fn
    if loss not in info.loss_names:
        raise ValidationError(f"unknown loss_fn {loss!r}; supported: {', '.join(info.loss_names)}")
    try:
        losses.validate_loss(loss, dict(request.loss_fn_config))
    except ValueError as err:
        raise ValidationError(f"loss_fn_config: {err}") from err
    if not request.data:
        raise ValidationError("data is empty; at least one datum is required")
    for i, datum in enumerate(request.data):
        _check_datum(datum, loss, info, f"data[{i}]")


def _check_datum(datum: Datum, loss: str, info: ModelInfo, where: str) -> None:
    check_tokens(datum.tokens, info, f"{where}.model_input")
    required = set(losses.required_inputs(loss))
    missing = sorted(required - datum.loss_fn_inputs.keys())
    if missing:
        raise ValidationError(f"{where}.loss_fn_inputs is missing {missing} required by loss {loss!r}")
    n = len(datum.tokens)
    for name, array in datum.loss_fn_inputs.items():
        field = f"{where}.loss_fn_inputs.{name}"
        if array.ndim == 0 or array.shape[0] != n:
            length = "a scalar" if array.ndim == 0 else f"length {array.shape[0]}"
            raise ValidationError(f"{field} has {length} but model_input has {n} tokens; they must be equal")
        if array.ndim > 2 or (array.ndim == 2 and loss != "cross_entropy"):
            raise ValidationError(
                f"{field} has shape {list(array.shape)}; only cross_entropy accepts 2-D (N, K) inputs"
            )
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise ValidationError(f"{field} contains NaN or infinite values")
    _check_targets(datum, where, info)


def _check_targets(datum: Datum, where: str, info: ModelInfo) -> None:
    targets = datum.loss_fn_inputs["target_tokens"] if "target_tokens" in datum.loss_fn_inputs else None
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


def check_base_model(base_model: str | None, info: ModelInfo) -> None:
    if base_model is not None and base_model != info.base_model:
        raise ValidationError(f"unknown base_model {base_model!r}; this server serves {info.base_model!r}")


def check_adam(adam: AdamParams) -> None:
    if adam.learning_rate < 0:
        raise ValidationError(f"adam_params.learning_rate must be >= 0, got {adam.learning_rate}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(adam, name) < 1.0:
            raise ValidationError(f"adam_params.{name} must be in [0, 1), got {getattr(adam, name)}")
    if adam.eps <= 0 or adam.weight_decay < 0 or adam.grad_clip_norm < 0:
        raise ValidationError("adam_params: eps must be > 0, weight_decay and grad_clip_norm >= 0")


def check_checkpoint_name(name: str) -> None:
    if not NAME_PATTERN.match(name):
        raise ValidationError(f"checkpoint name {name!r} must be 1-255 characters of letters, digits, '_', '-', '.'")


def check_sample(request: SampleRequest, info: ModelInfo, max_num_samples: int, max_topk: int) -> None:
    check_tokens(request.prompt, info, "prompt")
    params = request.params
    if not 1 <= request.num_samples <= max_num_samples:
        raise ValidationError(f"num_samples {request.num_samples} is outside [1, {max_num_samples}]")
    if params.max_tokens < 1:
        raise ValidationError(f"sampling_params.max_tokens must be >= 1, got {params.max_tokens}")
    total = len(request.prompt) + params.max_tokens
    if total > info.max_seq_len:
        raise ValidationError(
            f"prompt ({len(request.prompt)} tokens) + sampling_params.max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the maximum length {info.max_seq_len}"
        )
    if params.temperature < 0 or not 0 < params.top_p <= 1 or (params.top_k != -1 and params.top_k < 1):
        raise ValidationError("sampling_params: temperature must be >= 0, top_p in (0, 1], top_k -1 or >= 1")
    if any(not 0 <= t < info.vocab_size for t in params.stop_token_ids):
        raise ValidationError(f"sampling_params.stop has token ids outside the vocabulary [0, {info.vocab_size})")
    if not 0 <= request.topk_prompt_logprobs <= max_topk:
        raise ValidationError(f"topk_prompt_logprobs {request.topk_prompt_logprobs} is outside [0, {max_topk}]")
