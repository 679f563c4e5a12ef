"""gpt-oss's checkpoint layout of the experts, to and from our per-expert [out, in] tensors, and MXFP4.

transformers (and the dequantized hub copies) store each layer's experts fused: `mlp.experts.gate_up_proj`
[X, D, 2F] (in, out; gate and up interleaved along 2F, gate first), `mlp.experts.down_proj` [X, F, D], and
their biases `gate_up_proj_bias` [X, 2F], `down_proj_bias` [X, D]. The hub's `openai/gpt-oss-*` files store
the two weights in MXFP4 instead: `*_blocks` uint8 [X, out, in/32, 16] (two FP4 values a byte, the low
nibble first) and `*_scales` uint8 [X, out, in/32] (one power-of-two scale per 32 values). The loader reads
either and streams them as the per-expert tensors our stacked `ExpertLinear`s hold
(`mlp.experts.{e}.gate_up_proj.weight` [2F, D], `.bias`), dequantized to float32 here and cast to the
serving dtype by the loader; a blocks tensor waits for its scales (and the reverse) until both have streamed.
`stored_shapes` is the same mapping from a header's shapes alone (`tx.models.checkpoint_check`), and
`check_pairs` what the loader's pairing requires of the blocks and scales.

MXFP4 (the OCP microscaling format): an FP4 E2M1 element is a sign bit, two exponent bits and one mantissa
bit (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives); an E8M0 scale is the power of two 2^(s - 127).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([FP4_E2M1, -FP4_E2M1])  # index = the 4-bit code (sign bit highest)
BLOCK = 32  # elements sharing one scale
QUANTIZED = ("_blocks", "_scales")
FUSED = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} (16 bytes a block)")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, BLOCK)
    scaled = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return scaled.reshape(*scales.shape[:-1], -1)


def per_expert(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """A gpt-oss checkpoint's tensors with the fused (or quantized) expert tensors streamed per expert in our
    [out, in] layout; every other tensor as it is. A quantized weight missing its partner is an error."""
    waiting: dict[str, np.ndarray] = {}
    for key, array in tensors:
        _check_rank(key, array.shape)
        if is_quantized(key):
            base = key[: -len("_blocks")]
            partner = base + ("_scales" if key.endswith("_blocks") else "_blocks")
            if partner not in waiting:
                waiting[key] = np.asarray(array)
                continue
            blocks, scales = (array, waiting.pop(partner)) if key.endswith("_blocks") else (waiting.pop(partner), array)
            yield from _split(base, dequantize_mxfp4(np.asarray(blocks), np.asarray(scales)), ".weight")
        elif _fused_name(key):
            yield from _split(key, np.asarray(array).transpose(0, 2, 1), ".weight")  # [X, in, out] -> [X, out, in]
        elif key.endswith("_bias") and _fused_name(key[: -len("_bias")]):
            yield from _split(key[: -len("_bias")], np.asarray(array), ".bias")
        else:
            yield key, array
    if waiting:
        raise ValueError(f"MXFP4 tensor {sorted(waiting)[0]!r} has no matching blocks/scales tensor")


def is_quantized(key: str) -> bool:
    """An MXFP4 `*_blocks` / `*_scales` tensor of a fused expert weight."""
    return key.endswith(QUANTIZED) and _fused_name(key[: -len("_blocks")])


def _rank_of(key: str) -> int | None:
    """The number of axes a fused expert tensor must have (None: not one)."""
    if is_quantized(key):
        return 4 if key.endswith("_blocks") else 3
    if _fused_name(key):
        return 3
    return 2 if key.endswith("_bias") and _fused_name(key[: -len("_bias")]) else None


def _check_rank(key: str, shape: tuple[int, ...]) -> None:
    want = _rank_of(key)
    if want is not None and len(shape) != want:
        raise ValueError(f"tensor {key!r} has shape {tuple(shape)}; a gpt-oss expert tensor like it has {want} axes")


def stored_shapes(key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs `per_expert` streams for a stored tensor of `shape`, from its header alone: a
    blocks tensor stands for its dequantized weight, a scales tensor for nothing (`check_pairs` checks it)."""
    _check_rank(key, shape)
    one: tuple[int, ...]
    if is_quantized(key):
        if key.endswith("_scales"):
            return []
        base, one, suffix = key[: -len("_blocks")], (shape[1], shape[2] * shape[3] * 2), ".weight"
    elif _fused_name(key):
        base, one, suffix = key, (shape[2], shape[1]), ".weight"
    elif _rank_of(key) == 2:
        base, one, suffix = key[: -len("_bias")], (shape[1],), ".bias"
    else:
        return [(key, tuple(shape))]
    block, name = base.rsplit(".", 1)
    return [(f"{block}.{e}.{name}{suffix}", one) for e in range(shape[0])]


def check_pairs(quantized: dict[str, tuple[int, ...]]) -> None:
    """Every MXFP4 blocks tensor has its scales and the reverse, scales [..., G] for blocks [..., G, 16]."""
    for key in sorted(quantized):
        base = key[: -len("_blocks")]
        blocks, scales = quantized.get(base + "_blocks"), quantized.get(base + "_scales")
        if blocks is None or scales is None:
            raise ValueError(f"MXFP4 tensor {key!r} has no matching blocks/scales tensor")
        if tuple(blocks[:-1]) != tuple(scales) or blocks[-1] != BLOCK // 2:
            raise ValueError(f"MXFP4 blocks {base}_blocks {tuple(blocks)} do not match its scales {tuple(scales)}")


def _fused_name(key: str) -> bool:
    return key.rsplit(".", 2)[-2:-1] == ["experts"] and key.rsplit(".", 1)[-1] in FUSED


def _split(base: str, stacked: np.ndarray, suffix: str) -> Iterator[tuple[str, np.ndarray]]:
    """`...experts.gate_up_proj` and its [X, ...] stack -> one `...experts.{e}.gate_up_proj{suffix}` each."""
    block, name = base.rsplit(".", 1)
    for e in range(stacked.shape[0]):
        yield f"{block}.{e}.{name}{suffix}", stacked[e]


def fused(key: str, stacked: np.ndarray) -> tuple[str, np.ndarray]:
    """Our `...mlp.experts.gate_up_proj.weight` [X, out, in] (or `.bias` [X, out]) -> the checkpoint's fused
    tensor (`...mlp.experts.gate_up_proj` [X, in, out], `...gate_up_proj_bias`), unquantized."""
    base, kind = key.rsplit(".", 1)
    if kind == "bias":
        return base + "_bias", stacked
    return base, np.ascontiguousarray(stacked.transpose(0, 2, 1))


class MXFP4Experts:
    """`tx.lora.merge_experts.Dequantizer` for gpt-oss's MXFP4 experts: a blocks and scales pair as the fused
    float tensor transformers stores unquantized ([X, in, out]), in bfloat16, which holds every MXFP4 value
    exactly."""

    def is_quantized(self, name: str) -> bool:
        return is_quantized(name)

    def partner(self, name: str) -> str:
        base = name[: -len("_blocks")]
        return base + ("_scales" if name.endswith("_blocks") else "_blocks")

    def dequantize(self, name: str, tensor: np.ndarray, partner: np.ndarray) -> tuple[str, np.ndarray]:
        blocks, scales = (tensor, partner) if name.endswith("_blocks") else (partner, tensor)
        weight = dequantize_mxfp4(np.asarray(blocks), np.asarray(scales)).transpose(0, 2, 1)  # [X, in, out]
        return name[: -len("_blocks")], np.ascontiguousarray(weight.astype(ml_dtypes.bfloat16))
