"""Rotary position scaling read from a Hugging Face config as transformers reads it: `RopeScaling` (llama3,
linear, YaRN) and `rope_scaling_of`, which every family's config parser calls.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling (`rope_type` "llama3" as in Llama 3.1/3.2, "linear", or "yarn" as in
    gpt-oss: `beta_fast` / `beta_slow` bound the ramp between extrapolated and interpolated frequencies,
    `truncate` rounds its ends to whole dimensions, and q and k are scaled by `attention_factor`)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    given_attention_factor: float | None = None  # the config's `attention_factor`, which wins when set
    mscale: float | None = None  # else the ratio of two mscales (DeepSeek's YaRN), when both are set
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        numbers = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                   "beta_slow")  # fmt: skip
        optional = ("given_attention_factor", "mscale", "mscale_all_dim")
        for name in numbers + tuple(n for n in optional if getattr(self, n) is not None):
            value = getattr(self, name)  # NaN passed `<= 0`, and a zero divided at the first forward
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"rope_scaling.{name} must be a finite number > 0, got {value}")
        if self.rope_type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling.low_freq_factor ({self.low_freq_factor}) must be below high_freq_factor "
                f"({self.high_freq_factor})"
            )

    @property
    def attention_factor(self) -> float:
        """YaRN's scale of q and k (each; the scores by its square): the config's `attention_factor`, else
        mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else 0.1 ln(factor) + 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.given_attention_factor is not None:
            return float(self.given_attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor, 1.0)


def _mscale(factor: float, scale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(params)


ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
             "beta_slow", "truncate", "original_max_position_embeddings", "attention_factor", "mscale",
             "mscale_all_dim"}  # fmt: skip


def rope_scaling_of(hf: dict[str, Any], max_positions: int = 4096) -> RopeScaling | None:
    """The config's rotary scaling as transformers reads it: every key its llama3, linear and YaRN scalings
    read (YaRN's `attention_factor` and mscales had been dropped: logits 2.3 off); others it ignores, and so
    does this. A zero mscale means none, as there."""
    params = {k: v for k, v in rope_params(hf).items() if k in ROPE_KEYS and v is not None}
    params = {k: v for k, v in params.items() if not (k in ("mscale", "mscale_all_dim") and v == 0)}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return None
    # the pre-training length: a top-level field first (as transformers), then the rope's, then the context
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = original or hf.get("max_position_embeddings") or max_positions
    if rope_type == "yarn" and "factor" not in params:  # DeepSeek-style: the ratio of the two lengths
        params["factor"] = (hf.get("max_position_embeddings") or max_positions) / original
    params.pop("rope_theta", None)
    params.pop("type", None)
    params["original_max_position_embeddings"] = original
    params["given_attention_factor"] = params.pop("attention_factor", None)
    return RopeScaling(rope_type=rope_type, **params)
