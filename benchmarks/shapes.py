"""Model shapes the benchmarks use, and a random-weight model built directly on device (no files).

`tiny` and `small` match the presets of the side-by-side bench scripts; `qwen3-0.6b` is the real
Qwen3-0.6B architecture. Weights are random normals: throughput does not depend on their values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.layers import LoRASpec
from tx.models.causal_lm import CausalLM, abstract_model
from tx.models.config import ModelConfig

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}


def model_config(shape: str, dtype: str = "float32") -> ModelConfig:
    hf = {
        **SHAPES[shape],
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
    }
    return ModelConfig.from_hf(hf, dtype=dtype)


def random_model(shape: str, lora: LoRASpec | None = None, dtype: str = "float32", seed: int = 0) -> CausalLM:
    cfg = model_config(shape, dtype)
    graphdef, state = nnx.split(abstract_model(cfg, lora))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = [
        jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) * 0.02 for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, filled))


def param_count(cfg: ModelConfig) -> int:
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    attn = D * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return L * (attn + 3 * D * F) + V * D * (1 if cfg.tie_word_embeddings else 2)
