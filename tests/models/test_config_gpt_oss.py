"""gpt-oss config.json parsing: the hub's file (OpenAI's field names, MXFP4 quantization_config) and
transformers' own give the same config; unknown or unsupported fields are rejected by name."""

import json

import pytest

from tx.models.config import ModelConfig

HUB = {  # the fields of openai/gpt-oss-20b's config.json, at a tiny size
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 32,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 256,
}  # fmt: skip


def transformers_dict(tmp_path) -> dict:
    """The config.json transformers writes for the same model (its defaults: YaRN and alternating layers)."""
    from transformers import GptOssConfig

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    extra = {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}
    config = GptOssConfig(**{k: HUB[k] for k in keys}, **extra, architectures=HUB["architectures"])
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_hub_and_transformers_configs_agree(tmp_path):
    hub, ours = ModelConfig.from_hf(HUB), ModelConfig.from_hf(transformers_dict(tmp_path))
    assert hub == ours.replace(dtype=hub.dtype)
    assert hub.dtype == "bfloat16"  # the hub names no dtype: its tensors are bf16
    assert hub.sliding_layers == (0, 2) and hub.sliding_window == 128
    assert hub.attention_bias and hub.attention_sinks and not hub.qk_norm
    assert hub.moe is not None and hub.moe.top_k == 2 and hub.moe.experts == 4 and hub.moe.expert_size == 32
    assert hub.moe.gpt_oss is not None and (hub.moe.gpt_oss.alpha, hub.moe.gpt_oss.limit) == (1.702, 7.0)
    yarn = hub.rope_scaling
    assert yarn is not None and yarn.rope_type == "yarn" and not yarn.truncate
    assert (yarn.factor, yarn.beta_fast, yarn.beta_slow, yarn.original_max_position_embeddings) == (32, 32, 1, 4096)
    assert hub.rope_theta == 150000.0 and abs(yarn.attention_factor - 1.3465735902799727) < 1e-12


def test_no_window_means_every_layer_attends_fully():
    cfg = ModelConfig.from_hf({**HUB, "sliding_window": None})
    assert cfg.sliding_layers == () and cfg.sliding_window == 0


def test_rope_absent_is_transformers_default_yarn_and_empty_is_plain():
    """transformers gives a config with no rope parameters its default YaRN, and one with `{}` plain rope."""
    bare = {k: v for k, v in HUB.items() if k not in ("rope_scaling", "rope_parameters")}
    absent = ModelConfig.from_hf(bare).rope_scaling
    assert absent is not None and (absent.factor, absent.original_max_position_embeddings) == (32, 4096)
    assert ModelConfig.from_hf({**bare, "rope_parameters": {}}).rope_scaling is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_sliding_window": True}, "fields SmolGym does not support for gpt_oss: ['use_sliding_window']"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "only the hub's mxfp4"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"experts_per_token": 3}, "disagree"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "not supported for gpt_oss"),
        ({"swiglu_limit": 0.0}, "swiglu_limit must be > 0"),
        ({"num_local_experts": 1}, "num_experts_per_tok must be in 1..num_experts"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_rejected(change, message):
    with pytest.raises(ValueError, match=None) as err:
        ModelConfig.from_hf({**HUB, **change})
    assert message in str(err.value)
