"""What each Tinker loss takes: its `loss_fn_config` keys with defaults and its `loss_fn_inputs`.

The one table that both sides read: the API validates requests against it before queueing (see
`tx.api.validate`), and the engine (`tx.engine.losses`, `train_batch`) fills defaults and lays out
config columns from it without checking again. Leaf module: numpy-free, JAX-free, imports only
`tx.protocol`. The formulas themselves live in `tx.engine.losses`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from tx.protocol import LOSS_NAMES

# Column order of the engine's per-datum config rows; a loss leaves the columns it does not use at 0.
CONFIG_COLUMNS: tuple[str, ...] = ("clip_low_threshold", "clip_high_threshold", "beta", "truncation", "kl_coeff")

LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004},
    "stable_reinforce": {"truncation": 2.0, "kl_coeff": 0.0},
}

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": (*_RL_INPUTS, "sequence_ratio_mask"),
    # q: the behaviour logprobs. The datum carries them (as the cookbook does for every RL loss).
    "stable_reinforce": _RL_INPUTS,
}

# Every input the engine reads, and whether it holds token ids (integers) or real numbers. `weights`
# is optional for every loss; inputs of other names are ignored.
INPUT_IS_TOKEN_IDS: dict[str, bool] = {
    "target_tokens": True,
    "weights": False,
    "logprobs": False,
    "advantages": False,
    "sequence_ratio_mask": False,
}
# Inputs that may be 2-D [N, K] (top-K soft targets), for cross_entropy only, always the same shape.
TOP_K_INPUTS: tuple[str, ...] = ("target_tokens", "weights")
TOP_K_LOSSES: tuple[str, ...] = ("cross_entropy",)


def validate_loss(name: str, config: dict[str, Any] | None) -> dict[str, float]:
    """Check a loss name and its loss_fn_config; return the config with defaults filled in.

    Raises ValueError (a user error) for an unknown loss, an unknown or non-numeric key, a value below its
    key's bound (`LOWEST`), or clip thresholds out of order.
    """
    if name not in LOSS_CONFIG_DEFAULTS:
        raise ValueError(f"unsupported loss_fn {name!r}; supported: {', '.join(LOSS_NAMES)}")
    defaults = LOSS_CONFIG_DEFAULTS[name]
    filled = dict(defaults)
    for key, value in (config or {}).items():
        if key not in defaults:
            allowed = ", ".join(defaults) or "none"
            raise ValueError(f"unknown loss_fn_config key {key!r} for loss {name!r}; allowed keys: {allowed}")
        filled[key] = _as_float(key, value)
        _check_range(name, key, filled[key])
    if filled.get("clip_low_threshold", 0.0) > filled.get("clip_high_threshold", math.inf):
        raise ValueError(f"loss {name!r}: clip_low_threshold must not exceed clip_high_threshold, got {filled}")
    return filled


# Values below these turn a loss against its purpose: a ratio is never negative, so a negative clip bound is
# a mistake; a negative `beta` or `kl_coeff` rewards leaving the sampling policy without bound; a
# `truncation` at or below 0 flips the sign of every importance weight, so the run unlearns what it samples.
LOWEST: dict[str, tuple[float, bool]] = {  # key -> (bound, whether the bound itself is allowed)
    "clip_low_threshold": (0.0, True),
    "clip_high_threshold": (0.0, True),
    "beta": (0.0, True),
    "kl_coeff": (0.0, True),
    "truncation": (0.0, False),
}


def _check_range(name: str, key: str, value: float) -> None:
    bound, inclusive = LOWEST[key]
    if value < bound or (value == bound and not inclusive):
        relation = ">=" if inclusive else ">"
        raise ValueError(f"loss {name!r}: loss_fn_config key {key!r} must be {relation} {bound:g}, got {value:g}")


# The engine computes losses in float32: a larger value is infinite there (beta = 1e300 times a zero
# (p - q)^2 made a NaN loss, and the next optim_step refused the gradient, blaming the inputs).
FLOAT32_MAX = 3.4e38


def _as_float(key: str, value: Any) -> float:
    """A number float32 holds; an integer too large for a float (a 400-digit one) is refused like infinity."""
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
        shown = repr(value)[:40]
    except (OverflowError, ValueError):
        number, shown = math.inf, "an integer too large for a float"
    if not abs(number) <= FLOAT32_MAX:
        raise ValueError(f"loss_fn_config key {key!r} must be a finite number within ±{FLOAT32_MAX:g}, got {shown}")
    return number


def config_row(name: str, config: dict[str, Any] | None) -> list[float]:
    """One row of the engine's per-datum config (columns CONFIG_COLUMNS); the config was validated."""
    filled = {**LOSS_CONFIG_DEFAULTS[name], **{k: float(v) for k, v in (config or {}).items()}}
    return [filled.get(key, 0.0) for key in CONFIG_COLUMNS]


def loss_index(name: str) -> int:
    """The engine's per-datum loss kind of a loss name."""
    return LOSS_NAMES.index(name)


def required_inputs(name: str) -> tuple[str, ...]:
    """The loss_fn_inputs a datum must carry for this loss (`weights` is always optional)."""
    if name not in REQUIRED_INPUTS:
        raise ValueError(f"unsupported loss_fn {name!r}; supported: {', '.join(LOSS_NAMES)}")
    return REQUIRED_INPUTS[name]
