"""Per-expert adapter deltas merged into a checkpoint that stores a layer's experts fused, and MXFP4 bases.

An adapter names one module per expert (`model.layers.3.mlp.experts.5.up_proj`, gpt-oss's
`...experts.5.gate_up_proj`), which is a tensor of its own only in the per-expert layout. Checkpoints may
instead hold each layer's experts in one tensor, in one of two layouts:
- transformers 5's (Qwen3-MoE, Qwen3.5-MoE): `experts.gate_up_proj` [X, 2F, D], the gate's rows first then
  the up's, and `experts.down_proj` [X, D, F]: each expert's [out, in];
- gpt-oss's: `experts.gate_up_proj` [X, D, 2F] and `experts.down_proj` [X, F, D]: each expert's [in, out],
  its gate_up adapted whole (the checkpoint's interleaved columns, as the model holds them).
`FusedDeltas` maps the adapter's expert modules onto those tensors and adds each expert's delta into its
slice. gpt-oss's hub checkpoints store the two weights in MXFP4 (`*_blocks` + `*_scales`); a `Dequantizer`
(given by the caller: this layer does not know the format) turns them into the fused float tensor, which is
what the merge writes (quantizing the merged weights back would change them).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from tx.lora.peft import AdapterConfig, lora_delta

Pair = tuple[np.ndarray, np.ndarray]
_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|gate_up_proj|down_proj)$")
_FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "gate_up_proj": "gate_up_proj"}


class Dequantizer(Protocol):
    """A quantized base's expert tensors: which stored names are quantized, and each pair as its float tensor."""

    def is_quantized(self, name: str) -> bool: ...

    def partner(self, name: str) -> str: ...

    def dequantize(self, name: str, tensor: np.ndarray, partner: np.ndarray) -> tuple[str, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class _Part:
    expert: int
    proj: str
    pair: Pair


@dataclasses.dataclass(frozen=True)
class FusedDeltas:
    """The adapter's expert modules grouped by the fused tensor they change; `in_out`: gpt-oss's layout."""

    parts: Mapping[str, list[_Part]]
    in_out: bool

    @staticmethod
    def split(weights: Mapping[str, Pair], stored: set[str], in_out: bool) -> tuple[dict[str, Pair], FusedDeltas]:
        """(the modules whose own `.weight` is stored, the expert modules whose layer is stored fused)."""
        plain: dict[str, Pair] = {}
        parts: dict[str, list[_Part]] = {}
        for module, pair in weights.items():
            m = _EXPERT.match(module)
            fused = m and f"{m['block']}.{_FUSED_OF.get(m['proj'], m['proj'])}"
            if m and fused and f"{module}.weight" not in stored and fused in stored:
                parts.setdefault(fused, []).append(_Part(int(m["expert"]), m["proj"], pair))
            else:
                plain[module] = pair
        return plain, FusedDeltas(parts, in_out)

    def merged(self, name: str, tensor: np.ndarray, config: AdapterConfig) -> np.ndarray | None:
        """`tensor` with every expert's delta added, in float32; None when the adapter does not change it."""
        if name not in self.parts:
            return None
        out = tensor.astype(np.float32)  # a copy
        for part in self.parts[name]:
            delta = lora_delta(config, *part.pair)  # [out, in]
            rows = self._rows(part.proj, out.shape[1])
            target = out[part.expert, rows]
            change = delta.T if self.in_out else delta
            if change.shape != target.shape:
                raise ValueError(
                    f"adapter delta {change.shape} of expert {part.expert} does not fit {name} {out.shape}"
                )
            out[part.expert, rows] = target + change
        return out

    def _rows(self, proj: str, width: int) -> slice:
        """The slice of an expert's fused [2F, D] (or gpt-oss's whole tensor) one projection owns."""
        if self.in_out or proj in ("down_proj", "gate_up_proj"):
            return slice(None)
        half = width // 2
        return slice(0, half) if proj == "gate_proj" else slice(half, None)
