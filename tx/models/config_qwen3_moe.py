"""Qwen3-MoE (`model_type` `qwen3_moe`, `Qwen3MoeForCausalLM`) config.json -> `ModelConfig`, every field
accounted for.

The attention and norms are Qwen3's (per-head q/k norms, no biases); the MLP of each sparse layer is the
routed `MoE` block, that of each dense layer (`mlp_only_layers`, `decoder_sparse_step`) a SwiGLU MLP of
width `intermediate_size`. Each field is read, required to hold the one value we implement, or ignored for a
stated reason that leaves the logits unchanged; any other field is rejected by name, so a new variant
fails loudly instead of running wrong. The hub's files name the expert count `num_experts`; transformers 5
writes it as `num_local_experts` (its attribute map), so either is read.
"""

from __future__ import annotations

from typing import Any

from tx.models.config import ModelConfig, MoE, _dtype_of, transformer_shape
from tx.models.config_rope import rope_scaling_of

READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "rope_scaling", "dtype", "torch_dtype", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
}  # fmt: skip
# Fields that do not change the logits, and why.
IGNORED = {
    "architectures": "read by family_of",
    "model_type": "read by family_of",
    "transformers_version": "provenance",
    "initializer_range": "initialisation only",
    "use_cache": "generation switch",
    "bos_token_id": "tokenizer metadata",
    "eos_token_id": "tokenizer metadata",
    "pad_token_id": "tokenizer metadata",
    "router_aux_loss_coef": "weight of the load-balancing loss, which only training with output_router_logits adds",
    "output_router_logits": "returns the router's logits for that loss; the logits of the tokens are unchanged",
    "sliding_window": "read by transformers only when use_sliding_window (required false)",
    "max_window_layers": "read by transformers only when use_sliding_window (required false)",
}
# Fields whose one supported value is what the model implements.
REQUIRED: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def qwen3_moe_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    _check_values(hf)
    layers = int(hf["num_hidden_layers"])
    return ModelConfig(
        family="qwen3_moe",
        intermediate_size=int(hf.get("intermediate_size", 6144)),
        **transformer_shape(hf, eps=1e-6, theta=10000.0, max_positions=32768),
        rope_scaling=rope_scaling_of(hf, 32768),
        dtype=dtype or _dtype_of(hf),
        moe=_moe(hf, layers),
    )


def _check_values(hf: dict[str, Any]) -> None:
    unknown = sorted(set(hf) - READ - set(IGNORED) - set(REQUIRED))
    if unknown:
        raise ValueError(f"config.json has fields SmolGym does not support for qwen3_moe: {unknown}")
    for name, want in REQUIRED.items():
        if name in hf and hf[name] != want:
            raise ValueError(f"config sets {name}={hf[name]!r}; SmolGym supports only {want!r}")


def _moe(hf: dict[str, Any], layers: int) -> MoE:
    sparse = sparse_layers(hf, layers)
    if not sparse:
        raise ValueError("mlp_only_layers / decoder_sparse_step leave no sparse layer: that is a dense Qwen3")
    return MoE(
        experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 128),
        top_k=int(hf.get("num_experts_per_tok", 8)),
        expert_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def sparse_layers(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """As transformers decides: layer i is sparse unless listed in `mlp_only_layers`, and only every
    `decoder_sparse_step`-th layer (i + 1 divisible by it) is."""
    dense = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
