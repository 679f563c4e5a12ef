"""Qwen3-MoE config.json parsing: the hub's file and transformers' own, every unknown or unsupported field
rejected, and which layers are sparse decided as transformers decides it."""

import json

import pytest

from tx.models.config import ModelConfig
from tx.models.config_qwen3_moe import sparse_layers

HUB = {  # the fields of Qwen/Qwen3-30B-A3B's config.json, at a tiny size
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "decoder_sparse_step": 1,
    "eos_token_id": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 128,
}


def test_hub_config():
    cfg = ModelConfig.from_hf(HUB)
    assert cfg.family == "qwen3_moe" and cfg.qk_norm and cfg.dtype == "bfloat16" and cfg.rope_theta == 1e6
    assert cfg.moe is not None
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.expert_size, cfg.moe.norm_topk_prob) == (8, 2, 16, True)
    assert cfg.moe.sparse_layers == (0, 1) and cfg.moe.shared_expert_size == 0


def test_transformers_own_config_file():
    """transformers 5 writes the expert count as `num_local_experts` and the rotary as `rope_parameters`."""
    from transformers import Qwen3MoeConfig

    fields = ("hidden_size", "head_dim", "num_attention_heads", "num_experts", "num_hidden_layers")
    hf = json.loads(Qwen3MoeConfig(**{k: HUB[k] for k in fields}).to_json_string())
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    assert "num_local_experts" in hf and "num_experts" not in hf
    cfg = ModelConfig.from_hf(hf)
    assert cfg.moe is not None and cfg.moe.experts == 8 and cfg.moe.top_k == hf["num_experts_per_tok"]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"shared_expert_intermediate_size": 8}, "not support for qwen3_moe: \\['shared_expert_intermediate_size'\\]"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_only_layers": [0, 1]}, "no sparse layer"),
        ({"decoder_sparse_step": 3}, "no sparse layer"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in 1..num_experts \\(8\\)"),
    ],
)
def test_unsupported_fields_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**HUB, **change})


@pytest.mark.parametrize("step,dense", [(1, []), (2, []), (1, [0, 2]), (3, [5])])
def test_sparse_layers_as_transformers_decides(step, dense):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, moe_intermediate_size=4, head_dim=4)
    hf = Qwen3MoeConfig(
        **small, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=2,
        num_experts_per_tok=1, decoder_sparse_step=step, mlp_only_layers=dense,
    )  # fmt: skip
    layers = Qwen3MoeForCausalLM(hf).model.layers
    want = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert sparse_layers({"decoder_sparse_step": step, "mlp_only_layers": dense}, 6) == want


def test_dense_layers_hold_the_dense_mlp_parts():
    cfg = ModelConfig.from_hf({**HUB, "mlp_only_layers": [1]})
    assert cfg.moe is not None and cfg.moe.sparse_layers == (0,) and cfg.dense_mlp_layers == (1,)
    assert cfg.layers_holding("mlp", "down_proj") == (1,) and cfg.layers_holding("mlp", "experts") == (0,)
    assert cfg.layers_holding("self_attn", "q_proj") == (0, 1)
