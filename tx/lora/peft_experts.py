"""PEFT's fused form of a MoE block's expert adapters (`target_parameters`), to and from our per-expert form.

transformers 5 holds the routed experts fused: `mlp.experts.gate_up_proj` [X, 2F, D] (gate rows first) and
`mlp.experts.down_proj` [X, D, F]. PEFT adapts such a parameter with a `ParamWrapper`: one LoRA per expert,
stored as `lora_A.weight` [X*R, in] (expert-major rows) and `lora_B.weight` [out, R*X] (rank-major
columns); the two wrappers nest, `gate_up_proj` inside (`mlp.experts.base_layer.lora_*`), `down_proj`
outside (`mlp.experts.lora_*`), in the order of `target_parameters`. Our adapters are per expert and per
projection (gate and up apart). Written fused, expert e's gate and up become one LoRA of rank 2r,
A = [A_gate; A_up] and B block-diagonal, with twice the alpha, so the scaling stays alpha / r: the same
function, and the conversion PEFT itself applies to per-expert adapters of the families it knows. Read back,
a rank-2r fused LoRA whose off-diagonal blocks are zero splits exactly, and so does a rank-r one (A shared
by gate and up, as PEFT trains it); any other rank is refused. Stored orientation throughout the reading
side: (lora_A [r, in], lora_B [out, r]).

gpt-oss holds gate and up fused itself (`mlp.experts.{e}.gate_up_proj`, interleaved rows, as transformers'
`gate_up_proj` [X, D, 2F] is): its adapters are written as they are, rank r with the file's alpha, and read
back the same way (`fused_gate_up`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

Pair = tuple[np.ndarray, np.ndarray]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT nests the first inside
GATE_UP_PATTERN = r".*\.gate_up_proj"  # the rank_pattern / alpha_pattern key of the fused gate and up
_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|gate_up_proj|down_proj)$")
SPLIT, FUSED = frozenset({"gate_proj", "up_proj", "down_proj"}), frozenset({"gate_up_proj", "down_proj"})
INNER = ".base_layer"


def fuse(weights: Mapping[str, Pair], rank: int) -> tuple[dict[str, Pair], dict[str, Pair]]:
    """Our {module: (A [in, R], B [R, out])} -> (the non-expert modules as they are, the experts fused as
    stored tensors {`...mlp.experts.base_layer` / `...mlp.experts`: (lora_A, lora_B)})."""
    rest: dict[str, Pair] = {}
    blocks: dict[str, dict[int, dict[str, Pair]]] = {}
    for name, pair in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            rest[name] = pair
        else:
            blocks.setdefault(match["block"], {}).setdefault(int(match["expert"]), {})[match["proj"]] = pair
    stored: dict[str, Pair] = {}
    for block, experts in blocks.items():
        kinds = {frozenset(p) for p in experts.values()}
        if sorted(experts) != list(range(len(experts))) or kinds not in ({SPLIT}, {FUSED}):
            raise ValueError(f"{block}: a fused export needs gate, up and down adapters of every expert")
        ordered = [experts[e] for e in range(len(experts))]
        if kinds == {FUSED}:  # gpt-oss: gate_up is one projection already
            stored[block + INNER] = _stored([(a[:, :rank], b[:rank]) for a, b in (p["gate_up_proj"] for p in ordered)])
        else:
            stored[block + INNER] = _stored([_gate_up(p["gate_proj"], p["up_proj"], rank) for p in ordered])
        stored[block] = _stored([(a[:, :rank], b[:rank]) for a, b in (p["down_proj"] for p in ordered)])
    return rest, stored


def _gate_up(gate: Pair, up: Pair, rank: int) -> Pair:
    """One expert's gate and up adapters as one of rank 2r over the fused [2F, D] weight."""
    a = np.concatenate([gate[0][:, :rank], up[0][:, :rank]], axis=1)  # [D, 2r]
    F = gate[1].shape[1]
    b = np.zeros((2 * rank, 2 * F), np.float32)
    b[:rank, :F], b[rank:, F:] = gate[1][:rank], up[1][:rank]
    return a, b


def _stored(pairs: list[Pair]) -> Pair:
    """Per-expert (A [in, R], B [R, out]) -> PEFT's (lora_A [X*R, in], lora_B [out, R*X])."""
    a = np.concatenate([p[0].T for p in pairs], axis=0)
    b = np.stack([p[1] for p in pairs]).transpose(2, 1, 0)  # [out, R, X]
    return np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b.reshape(b.shape[0], -1), np.float32)


def fused_config(rank: int, alpha: float, split_gate_up: bool = True) -> dict[str, Any]:
    """The adapter_config.json fields of a fused export (gpt-oss's gate_up needs no rank of its own)."""
    if not split_gate_up:
        return {"target_parameters": list(TARGET_PARAMETERS)}
    alpha2 = int(2 * alpha) if float(2 * alpha).is_integer() else 2 * alpha
    return {
        "target_parameters": list(TARGET_PARAMETERS),
        "rank_pattern": {GATE_UP_PATTERN: 2 * rank},
        "alpha_pattern": {GATE_UP_PATTERN: alpha2},
    }


# ----------------------------------------------------------------------------------------------- read


def unfuse(found: dict[str, Pair], raw: Mapping[str, Any], fused_gate_up: bool = False) -> dict[str, Pair]:
    """Replace the fused expert tensors in `found` (stored orientation) by per-expert pairs at the file's rank
    `r`, each B scaled so that the file's plain `lora_alpha / r` gives the fused LoRA's own scaling;
    `fused_gate_up`: gate_up stays one module per expert (gpt-oss)."""
    r, alpha = int(raw["r"]), float(raw["lora_alpha"])
    out = {name: pair for name, pair in found.items() if not name.endswith((".experts", ".experts" + INNER))}
    for block in sorted(name for name in found if name.endswith(".experts")):
        if block + INNER not in found:
            raise ValueError(f"{block}: a fused expert adapter needs both gate_up_proj and down_proj")
        gate_up, down = found[block + INNER], found[block]
        if gate_up[1].shape[0] != 2 * down[0].shape[1]:  # nested the other way round
            gate_up, down = down, gate_up
        experts = down[0].shape[0] // r
        factor = _factor(raw, r, alpha, gate_up[0].shape[0] // experts)
        if fused_gate_up:
            out.update(_whole_gate_up(block, gate_up, experts, r, factor))
        else:
            out.update(_split_gate_up(block, gate_up, experts, r, factor))
        for e, (a, b) in enumerate(_per_expert(down, experts)):
            out[f"{block}.{e}.down_proj"] = (a, b)
    return out


def _factor(raw: Mapping[str, Any], r: int, alpha: float, fused_rank: int) -> float:
    own_alpha = float((raw.get("alpha_pattern") or {}).get(GATE_UP_PATTERN, alpha))
    return (own_alpha / fused_rank) / (alpha / r)


def _per_expert(pair: Pair, experts: int) -> list[Pair]:
    """PEFT's (lora_A [X*R, in], lora_B [out, R*X]) -> per expert (lora_A [R, in], lora_B [out, R])."""
    a, b = pair
    R = a.shape[0] // experts
    a3, b3 = a.reshape(experts, R, -1), b.reshape(b.shape[0], R, experts)
    return [(a3[e], b3[:, :, e]) for e in range(experts)]


def _whole_gate_up(block: str, pair: Pair, experts: int, r: int, factor: float) -> dict[str, Pair]:
    out = {}
    for e, (a, b) in enumerate(_per_expert(pair, experts)):
        if a.shape[0] != r:
            raise ValueError(f"{block}.gate_up_proj: a fused LoRA of rank {a.shape[0]} in an adapter of rank {r}")
        out[f"{block}.{e}.gate_up_proj"] = (a, b * np.float32(factor))
    return out


def _split_gate_up(block: str, pair: Pair, experts: int, r: int, factor: float) -> dict[str, Pair]:
    out = {}
    for e, (a, b) in enumerate(_per_expert(pair, experts)):
        F, R = b.shape[0] // 2, a.shape[0]
        if R == r:  # A shared by gate and up
            gate, up = (a, b[:F]), (a, b[F:])
        elif R == 2 * r and not (np.any(b[:F, r:]) or np.any(b[F:, :r])):  # block-diagonal
            gate, up = (a[:r], b[:F, :r]), (a[r:], b[F:, r:])
        else:
            raise ValueError(f"{block}.gate_up_proj: a fused LoRA of rank {R} does not split into rank-{r} gate and up")
        out[f"{block}.{e}.gate_proj"] = (gate[0], gate[1] * np.float32(factor))
        out[f"{block}.{e}.up_proj"] = (up[0], up[1] * np.float32(factor))
    return out
