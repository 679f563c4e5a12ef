"""Model shapes the benchmarks use, a random-weight model built directly on device (no files), and the
peak memory a benchmark process reached.

`tiny` and `small` match the presets of the side-by-side bench scripts; `qwen3-0.6b` is the real
Qwen3-0.6B architecture. The `qwen3.5-*` shapes are the hybrid family (Gated DeltaNet + gated full
attention, 3 linear : 1 full): `qwen3.5-tiny` is `tiny`'s width over one group of the pattern (the device
check's dry run), `qwen3.5-small` is `small`'s width over 8 layers, `qwen3.5-9b-d4` the
published Qwen3.5-9B layer width over 4 layers (one group of the pattern). `qwen3-moe-small` and
`gpt-oss-small` are mixture-of-experts models of `small`'s width and depth: 8 experts, 2 picked per token,
each expert 768 wide, so a token's active MLP width (2 x 768) is `small`'s 1536; gpt-oss's layers alternate
sliding-window (128) and full attention. `qwen3.5-moe-small` is the hybrid Qwen3.5-MoE over one group of
the pattern with the same experts plus a shared expert of the same width. Weights are random normals:
throughput does not depend on their values (the routers spread tokens roughly evenly).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tx.engine.train_step import flat
from tx.lora.layers import LoRASpec
from tx.models.config import ModelConfig
from tx.models.weights import abstract_for, save_hf
from tx.tuning import Tuning

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
    "qwen3.5-tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "qwen3.5-small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    "qwen3.5-9b-d4": dict(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "qwen3.5-moe-small": dict(
        vocab_size=8192,
        hidden_size=512,
        moe_intermediate_size=768,
        shared_expert_intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3-moe-small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "gpt-oss-small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
    ),
}
COMMON = {"tie_word_embeddings": True, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}
GPT_OSS_ROPE |= {"truncate": False, "original_max_position_embeddings": 4096}


def hf_config(shape: str) -> dict[str, Any]:
    """The `config.json` of a shape, as a Hugging Face checkpoint of its family would carry it."""
    if shape.startswith("qwen3-moe"):
        return {
            **SHAPES[shape],
            **COMMON,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "rope_theta": 1e6,
        }
    if shape.startswith("gpt-oss"):
        return {
            **SHAPES[shape],
            **COMMON,
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "rope_parameters": GPT_OSS_ROPE,
        }
    if shape.startswith("qwen3.5"):
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        hf = {**SHAPES[shape], **COMMON, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
        if "num_experts" in hf:
            hf.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
        hf.update(linear_conv_kernel_dim=4, rope_parameters=rope, full_attention_interval=4)
        return hf
    return {**SHAPES[shape], **COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1e6}


def model_config(shape: str, dtype: str = "float32") -> ModelConfig:
    return ModelConfig.from_hf(hf_config(shape), dtype=dtype)


def write_checkpoint(shape: str, out_dir: Path) -> Path:
    """A random-weight float32 Hugging Face directory of `shape` (config.json + model.safetensors, no
    tokenizer), for benchmarks that load a model the way the server does (`tx.engine.build_runner`)."""
    source = out_dir.with_name(f"{out_dir.name}.config")
    source.mkdir(parents=True, exist_ok=True)
    (source / "config.json").write_text(json.dumps(hf_config(shape)))
    cfg = model_config(shape)
    _, state = random_state(cfg)
    save_hf(flat(state), cfg, source, out_dir)
    return out_dir


def random_state(
    cfg: ModelConfig, lora: LoRASpec | None = None, seed: int = 0, tuning: Tuning | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Random normal weights (norms at one), drawn on the device by one compiled program from an `rbg` key:
    drawn leaf by leaf, each weight shape compiled its own kernel, and threefry's bits compile slowly (15 s
    of a 40 s `tiny` benchmark on CPU; 4.6 s this way). `tuning`: the backend choices the model is built
    with (default: the backend's table)."""
    graphdef, state = nnx.split(abstract_for(cfg, lora, remat=False, tuning=tuning))
    flat = nnx.to_flat_state(state)
    specs = [(var.shape, var.dtype, str(path[-2]).endswith("norm")) for path, var in flat]

    @jax.jit
    def draw(key: jax.Array) -> list[jax.Array]:
        keys = jax.random.split(key, len(specs))
        return [
            jnp.ones(shape, dtype) if norm else (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
            for k, (shape, dtype, norm) in zip(keys, specs, strict=True)
        ]

    for (_, var), value in zip(flat, draw(jax.random.key(seed, impl="rbg")), strict=True):
        var.set_value(value)
    return graphdef, state


def random_model(shape: str, lora: LoRASpec | None = None, dtype: str = "float32", seed: int = 0) -> Any:
    return nnx.merge(*random_state(model_config(shape, dtype), lora, seed))


def active_param_count(cfg: ModelConfig) -> int:
    """Weights a token's forward pass multiplies by on average (the base model's, adapters excluded), counted
    from the model's own structure: a tied embedding once, for the output projection; a routed expert's
    weights at top_k / experts (a dense model's: all of them)."""
    _, params, _ = nnx.split(abstract_for(cfg, None, remat=False), nnx.Param, ...)
    share = 1.0 if cfg.moe is None else cfg.moe.top_k / cfg.moe.experts
    total = 0.0
    for path, var in nnx.to_flat_state(params):
        total += math.prod(var.shape) * (share if "experts" in map(str, path) else 1.0)
    return int(total)


def peak_memory() -> dict[str, Any]:
    """The process's peak memory so far: the first device's allocator peak where it reports one (GPU, TPU),
    else the host's peak resident set (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"peak_memory_gib": round(stats["peak_bytes_in_use"] / 2**30, 2), "peak_memory_of": "device"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_memory_gib": round(rss / 2**30, 2), "peak_memory_of": "host RSS"}
