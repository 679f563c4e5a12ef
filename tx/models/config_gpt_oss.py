"""gpt-oss (`model_type` `gpt_oss`, `GptOssForCausalLM`) config.json -> `ModelConfig`, every field accounted for.

gpt-oss is a mixture-of-experts decoder: attention with q/k/v/o biases and one learned sink logit per head,
sliding-window layers alternating with full ones (`layer_types`), YaRN rotary scaling, and in every layer a
routed MoE block whose router and experts have biases and whose experts run a clamped SwiGLU
(`ClampedSwiGLU`). Each field is read, required to hold the one value we implement, or ignored for a stated
reason that leaves the logits unchanged; any other field is rejected by name. The hub's files carry the
names of OpenAI's release besides transformers' (`experts_per_token`, `initial_context_length`,
`rope_scaling` + `rope_theta`), and a `quantization_config` for their MXFP4 experts, which the loader
dequantizes (`tx.models.gpt_oss_checkpoint`).
"""

from __future__ import annotations

from typing import Any

from tx.models.config import (
    ClampedSwiGLU,
    ModelConfig,
    MoE,
    _dtype_of,
    transformer_shape,
)
from tx.models.config_rope import RopeScaling, rope_params, rope_scaling_of

READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "rope_scaling", "dtype", "torch_dtype", "num_local_experts", "num_experts",
    "num_experts_per_tok", "experts_per_token", "swiglu_alpha", "swiglu_limit", "attention_bias", "layer_types",
    "sliding_window", "quantization_config",
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
    "hidden_act": "transformers' gpt-oss experts run their clamped SwiGLU whatever it names",
    "router_aux_loss_coef": "weight of the load-balancing loss, which only training with output_router_logits adds",
    "output_router_logits": "returns the router's logits for that loss; the logits of the tokens are unchanged",
    "initial_context_length": "the release's pre-training length, which YaRN reads as original_max_position_embeddings",
}
# Fields whose one supported value is what the model implements.
REQUIRED: dict[str, Any] = {"attention_dropout": 0.0}
LAYER_KINDS = ("sliding_attention", "full_attention")


def gpt_oss_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    _check_values(hf)
    layers = int(hf["num_hidden_layers"])
    window, sliding = _sliding(hf, layers)
    return ModelConfig(
        family="gpt_oss",
        intermediate_size=int(hf.get("intermediate_size", 2880)),
        **transformer_shape(hf, eps=1e-5, theta=150000.0, max_positions=131072),
        rope_scaling=_yarn(hf),
        # The hub's checkpoints store their unquantized tensors in bfloat16 without naming a dtype.
        dtype=dtype or (_dtype_of(hf) if hf.get("dtype") or hf.get("torch_dtype") else "bfloat16"),
        moe=_moe(hf, layers),
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=window,
        sliding_layers=sliding,
    )


def _check_values(hf: dict[str, Any]) -> None:
    unknown = sorted(set(hf) - READ - set(IGNORED) - set(REQUIRED))
    if unknown:
        raise ValueError(f"config.json has fields SmolGym does not support for gpt_oss: {unknown}")
    for name, want in REQUIRED.items():
        if name in hf and hf[name] != want:
            raise ValueError(f"config sets {name}={hf[name]!r}; SmolGym supports only {want!r}")
    quant = hf.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        raise ValueError(f"quantization_config {quant!r} is not supported (only the hub's mxfp4 experts)")
    picks = {hf[k] for k in ("num_experts_per_tok", "experts_per_token") if hf.get(k) is not None}
    if len(picks) > 1:
        raise ValueError(f"num_experts_per_tok and experts_per_token disagree: {sorted(picks)}")


def _sliding(hf: dict[str, Any], layers: int) -> tuple[int, tuple[int, ...]]:
    """(window, the sliding layers): transformers' default alternates, sliding first; with no window every
    layer attends fully."""
    kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(kinds) != layers or any(k not in LAYER_KINDS for k in kinds):
        raise ValueError(f"layer_types {kinds} must list one of {LAYER_KINDS} for each of {layers} layers")
    window = int(hf.get("sliding_window", 128) or 0)  # transformers' default; null: no window
    if window < 0:
        raise ValueError(f"sliding_window must be >= 0, got {window}")
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention") if window else ()
    return (window if sliding else 0), sliding


# transformers' rotary scaling for a gpt-oss config that names none (`GptOssConfig`)
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip


def _yarn(hf: dict[str, Any]) -> RopeScaling | None:
    params = rope_params(hf)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:  # absent; {} means plain rope
        hf = {**hf, "rope_parameters": DEFAULT_YARN}
    elif (params.get("rope_type") or params.get("type") or "default") not in ("default", "yarn"):
        raise ValueError(f"rope parameters {params} are not supported for gpt_oss (YaRN or none)")
    return rope_scaling_of(hf, 131072)


def _moe(hf: dict[str, Any], layers: int) -> MoE:
    return MoE(
        experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 128),
        top_k=int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 4),
        expert_size=int(hf.get("intermediate_size", 2880)),
        norm_topk_prob=True,  # the softmax over the picked logits sums to 1 over them
        sparse_layers=tuple(range(layers)),
        gpt_oss=ClampedSwiGLU(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))),
    )
