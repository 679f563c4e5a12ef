"""`python -m tx.merge` for mixture-of-experts adapters into bases that store their experts fused: a gpt-oss
base in MXFP4 (written dequantized) and a Qwen3-MoE base in transformers 5's fused layout. transformers loads
each merged directory without peft and reproduces the adapter's logits (float32)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import GPT_OSS
from flax import nnx
from safetensors import safe_open
from test_gpt_oss_mxfp4 import quantized_copy
from test_qwen3_moe import HF, decisive_qwen3_moe, fused, rewritten

from tx import merge
from tx.lora import adapters, peft
from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam, LoRARows, slot_scale
from tx.lora.targets import MLP_TARGETS, SOFTMAX_ATTN
from tx.models.weights import load_model
from tx.tuning import CPU

RANK, ALPHA = 4, 8.0
TARGETS = frozenset({*SOFTMAX_ATTN, *MLP_TARGETS, "lm_head"})


def adapted(base: str, fused_experts: bool, out):
    """(model loaded from `base` whose slot 1 holds a random adapter, that adapter exported as PEFT to `out`)."""
    model, _ = load_model(base, lora=LoRASpec(2, RANK), progress=False, tuning=CPU)
    rng = np.random.RandomState(5)
    view = nnx.state(model, LoRAParam)
    for _, var in nnx.to_flat_state(view):
        var.set_value(jnp.asarray(0.1 * rng.randn(*var.shape), jnp.float32))
    nnx.update(model, view)
    targets = TARGETS & adapters.adapter_targets(view)
    weights = adapters.read_slot(view, 1, RANK, targets)
    peft.save_peft(out, peft.AdapterConfig(RANK, ALPHA, tuple(sorted(targets)), base), weights, fused_experts)
    return model


def on_slot_1(batch: int) -> LoRARows:
    return LoRARows(jnp.ones(batch, jnp.int32), jnp.stack([jnp.zeros(RANK), slot_scale(RANK, ALPHA, RANK)]))


def tensor_names(directory) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            names.update(f.keys())
    return names


def check_logits(model, merged_dir, cls, vocab: int) -> None:
    ids = np.random.RandomState(2).randint(0, vocab, (2, 10)).astype(np.int32)
    mine, _ = model(ids, rows=on_slot_1(2))
    plain, _ = model(ids)
    with torch.no_grad():
        want = cls.from_pretrained(merged_dir).eval()(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the adapter changed the model
    np.testing.assert_allclose(np.asarray(mine), want, atol=1e-4, rtol=0)


@pytest.mark.parity
def test_gpt_oss_adapter_merges_into_its_mxfp4_base_dequantized(tmp_path):
    """Blocks and scales in different shards; the merged directory holds the fused float experts and no
    quantization_config, and transformers' GptOssForCausalLM gives our slot's logits."""
    from transformers import GptOssForCausalLM

    quantized, _ = quantized_copy(tmp_path)
    model = adapted(str(quantized), True, tmp_path / "adapter")
    args = [str(tmp_path / "adapter"), str(tmp_path / "merged"), "--dtype", "float32"]
    assert merge.main(args) == 0
    names = tensor_names(tmp_path / "merged")
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == names
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    check_logits(model, tmp_path / "merged", GptOssForCausalLM, GPT_OSS["vocab_size"])


@pytest.mark.parity
def test_qwen3_moe_adapter_merges_into_a_fused_expert_base(tmp_path):
    """A base in transformers 5's fused layout (gate_up_proj [X, 2F, D], gate rows first): each expert's gate,
    up and down deltas land in their slices."""
    from transformers import Qwen3MoeForCausalLM

    ref = decisive_qwen3_moe(HF)
    ref.save_pretrained(tmp_path / "hub")
    base = rewritten(tmp_path / "hub", tmp_path / "base", fused)
    model = adapted(base, False, tmp_path / "adapter")
    assert merge.main([str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensor_names(tmp_path / "merged")
    check_logits(model, tmp_path / "merged", Qwen3MoeForCausalLM, HF["vocab_size"])
