"""gpt-oss's MXFP4 experts: our dequantization against transformers' own and against the format's
definition, and a tiny checkpoint quantized here (blocks and scales in different shards, as the hub may
place them) loading to the logits of the dequantized transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import GPT_OSS, build_gpt_oss
from safetensors.numpy import load_file, save_file

from tx.models.gpt_oss_checkpoint import dequantize_mxfp4
from tx.models.weights import load_model
from tx.tuning import CPU


def by_definition(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """FP4 E2M1 from its bits (sign, 2 exponent bits of bias 1, 1 mantissa bit; exponent 0 subnormal),
    two a byte with the low nibble first, times the E8M0 scale 2^(s - 127) of each 32-element block."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).astype(np.int64).reshape(*scales.shape, 32)
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = np.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
    values = sign * magnitude * 2.0 ** (scales.astype(np.int64)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., in] float -> (blocks uint8 [..., in/32, 16], scales uint8 [..., in/32]): each block's scale the
    smallest power of two that brings its largest magnitude within 6, each value rounded to the nearest
    E2M1 magnitude (an independent encoder: a table of the eight magnitudes and their codes)."""
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    top = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-30)
    exponent = np.ceil(np.log2(top / 6.0))
    scaled = blocks / 2.0**exponent
    nearest = np.abs(np.abs(scaled)[..., None] - grid).argmin(-1)
    codes = (nearest | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = exponent[..., 0] + 127
    return np.ascontiguousarray(packed, np.uint8), np.ascontiguousarray(scales, np.uint8)  # safetensors drops strides


def test_dequantization_matches_transformers_and_the_definition():
    """Every byte value and a range of scales, the block count and leading axes of a real expert stack."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.RandomState(0)
    blocks = rng.randint(0, 256, (3, 8, 4, 16)).astype(np.uint8)
    blocks[0, 0].flat[:256] = np.arange(256)[: blocks[0, 0].size]
    scales = rng.randint(100, 150, (3, 8, 4)).astype(np.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 8, 128) and ours.dtype == np.float32
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy().transpose(0, 2, 1))  # they return [X, in, out]
    np.testing.assert_array_equal(ours, by_definition(blocks, scales))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])


def quantized_copy(root: Path) -> tuple[Path, Path]:
    """A tiny gpt-oss as the hub ships it under `root / "mxfp4"` (experts in MXFP4, their blocks and scales
    in different shards, a `quantization_config`), and the same weights dequantized, as transformers saves
    them, under `root / "dequantized"`: (quantized dir, dequantized dir)."""
    build_gpt_oss(root / "plain")
    tensors = load_file(root / "plain" / "model.safetensors")
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize(value.transpose(0, 2, 1))  # the hub quantizes [X, out, in] along in
            tensors[key] = dequantize_mxfp4(blocks, scales).transpose(0, 2, 1).copy()
            shards[0][key + "_blocks"], shards[1][key + "_scales"] = blocks, scales
        else:
            shards[0][key] = value
    out = root / "mxfp4"
    out.mkdir()
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((root / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    dequantized = root / "dequantized"  # not over "plain": load_file's arrays may map that file
    dequantized.mkdir()
    save_file(tensors, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    (dequantized / "config.json").write_text((root / "plain" / "config.json").read_text())
    return out, dequantized


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(directory of a quantized checkpoint, the transformers model holding the dequantized experts)."""
    from transformers import GptOssForCausalLM

    out, dequantized = quantized_copy(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return out, GptOssForCausalLM.from_pretrained(dequantized).eval()


@pytest.mark.parity
def test_quantized_checkpoint_loads_to_the_dequantized_logits(quantized):
    path, ref = quantized
    model, cfg = load_model(str(path), progress=False, tuning=CPU)
    weight = np.asarray(model.model.layers.mlp.experts.gate_up_proj.weight[...])
    assert weight.shape == (2, GPT_OSS["num_local_experts"], 2 * GPT_OSS["intermediate_size"], GPT_OSS["hidden_size"])
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), want, atol=1e-4, rtol=0)


def test_the_header_check_passes_the_quantized_checkpoint(quantized):
    """`check_checkpoint` (uploads) places the MXFP4 tensors as the weights they dequantize to."""
    from tx.models.checkpoint_check import check_checkpoint

    assert check_checkpoint(quantized[0]).family == "gpt_oss"


def test_the_memory_budget_counts_the_dequantized_experts(quantized):
    """The model pool sizes a model from its headers (`weight_bytes`): MXFP4 blocks count as the weights
    they load as, their scales as nothing, so both copies of the same weights cost the same."""
    from tx.models.catalog import weight_bytes

    quantized_dir = quantized[0]
    for dtype in ("float32", "bfloat16"):
        assert weight_bytes(quantized_dir, dtype) == weight_bytes(quantized_dir.parent / "dequantized", dtype)


def test_blocks_without_scales_are_named(quantized, tmp_path):
    path, _ = quantized
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for name in sorted(set(index["weight_map"].values()))[:1]:
        (tmp_path / name).write_bytes((path / name).read_bytes())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scales")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    from tx.models.checkpoint_check import check_checkpoint

    for check in (lambda: load_model(str(tmp_path), progress=False, tuning=CPU), lambda: check_checkpoint(tmp_path)):
        with pytest.raises(ValueError, match=r"MXFP4 tensor 'model\.layers\.\d\.mlp\.experts\.\w+_blocks'"):
            check()
