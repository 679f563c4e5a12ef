"""Qwen3.5 / Qwen3.6 (`model_type` `qwen3_5`, and `qwen3_5_moe`) config.json -> `ModelConfig`, every field
accounted for.

Two checkpoint classes carry the same text model: `Qwen3_5ForConditionalGeneration` (the hub's form: the
text config nested under `text_config`, a vision tower beside it, tensors under `model.language_model.*`)
and `Qwen3_5ForCausalLM` (the text config at the top, tensors under `model.*`). Each field is either read,
required to hold the one value we implement, or ignored for a stated reason that leaves the logits
unchanged; any other field is rejected by name, so a new variant fails loudly instead of running wrong.
The MoE variant (`Qwen3_5MoeForConditionalGeneration`, `Qwen3_5MoeForCausalLM`) has the same layers with
a routed MoE block plus a sigmoid-gated shared expert as every layer's MLP (no dense MLP width); its router
always renormalises the chosen experts' weights.
"""

from __future__ import annotations

from typing import Any

from tx.models.config import LAYER_TYPES, LinearAttention, ModelConfig, MoE, _dtype_of, family_of

READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "rope_parameters",
    "rope_theta", "partial_rotary_factor", "dtype", "torch_dtype",
}  # fmt: skip
MOE_READ = READ - {"intermediate_size"} | {
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
}  # fmt: skip
MOE_IGNORED = {
    "router_aux_loss_coef": "weight of the load-balancing loss, which only training with output_router_logits adds",
    "output_router_logits": "returns the router's logits for that loss; the logits of the tokens are unchanged",
}
# Fields that do not change the text model's logits, and why.
IGNORED = {
    "architectures": "read by family_of",
    "model_type": "read by family_of",
    "transformers_version": "provenance",
    "initializer_range": "initialisation only",
    "use_cache": "generation switch",
    "bos_token_id": "tokenizer metadata",
    "eos_token_id": "tokenizer metadata",
    "pad_token_id": "tokenizer metadata",
    "mtp_num_hidden_layers": "the multi-token-prediction head (mtp.*) drafts tokens; it is not loaded",
    "mtp_use_dedicated_embeddings": "belongs to the mtp head",
}
# Fields whose one supported value is what the model implements.
REQUIRED: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "attn_output_gate": True,  # q_proj carries the query and a sigmoid output gate per head
    "mamba_ssm_dtype": "float32",  # the recurrent state is kept in float32
    "mlp_only_layers": [],
}
ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
# The multimodal wrapper's own fields: token ids of image/video placeholders and the vision tower's config.
# Text-only input never contains those tokens, and the vision tower is not loaded. Its special-token ids
# (eos/bos/pad) are read where stop tokens are decided (generation_config.json, then config.json), not here.
WRAPPER = {
    "architectures", "model_type", "text_config", "vision_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings", "transformers_version", "dtype",
    "torch_dtype", "eos_token_id", "bos_token_id", "pad_token_id",
}  # fmt: skip


def qwen3_5_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Either checkpoint class's config.json (dense or MoE) -> the text model's config."""
    family = family_of(hf)
    if "text_config" in hf:
        _reject_unknown(hf, WRAPPER, "config.json", family)
        text = dict(hf["text_config"])
        # transformers ties the multimodal model's lm_head by the wrapper's flag, not the text config's.
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
        text.setdefault("dtype", hf.get("dtype") or hf.get("torch_dtype"))
        return _text_config(text, dtype, "model.language_model", family)
    return _text_config(hf, dtype, "model", family)


def _reject_unknown(fields: dict[str, Any], known: set[str], where: str, family: str) -> None:
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where} has fields SmolGym does not support for {family}: {unknown}")


def _check_values(text: dict[str, Any], family: str) -> None:
    known = MOE_READ | set(MOE_IGNORED) if family == "qwen3_5_moe" else READ
    _reject_unknown(text, known | set(IGNORED) | set(REQUIRED), f"the {family} text config", family)
    for name, want in REQUIRED.items():
        if name in text and text[name] != want:
            raise ValueError(f"config sets {name}={text[name]!r}; SmolGym supports only {want!r}")


def _text_config(text: dict[str, Any], dtype: str | None, prefix: str, family: str) -> ModelConfig:
    _check_values(text, family)
    rope = _rope(text)
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kinds = _layer_types(text, layers)
    moe = _moe(text, layers) if family == "qwen3_5_moe" else None
    return ModelConfig(
        family=family,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        # the MoE variant has no dense MLP: its experts' width stands in (read by nothing)
        intermediate_size=int(text["intermediate_size"]) if moe is None else moe.expert_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        dtype=dtype or _dtype_of(text),
        layer_types=kinds,
        linear=_linear(text) if "linear_attention" in kinds else None,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        checkpoint_prefix=prefix,
        moe=moe,
    )


def _moe(text: dict[str, Any], layers: int) -> MoE:
    """transformers' defaults where a field is absent; every layer sparse, the top-k weights renormalised."""
    return MoE(
        experts=int(text.get("num_experts", 256)),
        top_k=int(text.get("num_experts_per_tok", 8)),
        expert_size=int(text.get("moe_intermediate_size", 512)),
        norm_topk_prob=True,
        sparse_layers=tuple(range(layers)),
        shared_expert_size=int(text.get("shared_expert_intermediate_size", 512)),
    )


def _rope(text: dict[str, Any]) -> dict[str, Any]:
    """Plain rotary on the leading `partial_rotary_factor` of each head. The multimodal rotary's sections
    (`mrope_section`) split the frequencies among three position streams that text-only input sets equal,
    which is exactly one-dimensional rotary; other rotary types are rejected."""
    rope: dict[str, Any] = {k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text}
    params = dict(text.get("rope_parameters") or {})
    _reject_unknown(params, ROPE_KEYS, "rope_parameters", "Qwen3.5")
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type {params['rope_type']!r} is not supported for Qwen3.5")
    rope.update({k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params})
    return rope


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, or, as transformers derives it, every `full_attention_interval`-th layer full."""
    interval = int(text.get("full_attention_interval", 4))
    derived = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    kinds = tuple(text.get("layer_types") or derived)
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {LAYER_TYPES}")
    if "full_attention_interval" in text and kinds != derived:
        raise ValueError("layer_types disagrees with full_attention_interval")
    return kinds


def _linear(text: dict[str, Any]) -> LinearAttention:
    return LinearAttention(
        key_heads=int(text.get("linear_num_key_heads", 16)),
        value_heads=int(text.get("linear_num_value_heads", 32)),
        key_head_dim=int(text.get("linear_key_head_dim", 128)),
        value_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
    )
