"""config.json values a model cannot be built from faithfully are refused by name, in every family and in
a multimodal checkpoint's `text_config`, never truncated or carried into NaN weights' arithmetic."""

import pytest
from test_config_gpt_oss import HUB as GPT_OSS
from test_config_qwen3_5 import multimodal
from test_config_qwen3_moe import HUB as QWEN3_MOE

from tx.models.config import ModelConfig

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

BAD = [
    ("num_hidden_layers", 2.5, "config.json num_hidden_layers must be a whole number, got 2.5"),
    ("num_attention_heads", True, "config.json num_attention_heads must be a whole number, got True"),
    ("head_dim", "8", "config.json head_dim must be a whole number, got '8'"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a finite number > 0"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number > 0, got nan"),
    ("max_position_embeddings", 0, "max_position_embeddings must be >= 1, got 0"),
    # bounded before any per-layer table is built: a MoE family's took ~2.4 h of Python for 10^6 layers
    ("num_hidden_layers", 10**6, "config.json num_hidden_layers must be at most 1024, got 1000000"),
    ("vocab_size", 1 << 26, "config.json vocab_size must be at most 4194304, got 67108864"),
    ("intermediate_size", 1 << 40, "config.json intermediate_size must be at most 2147483648, got 1099511627776"),
]


@pytest.mark.parametrize("key,value,message", BAD)
@pytest.mark.parametrize("base", [QWEN3, QWEN3_MOE, GPT_OSS], ids=["qwen3", "qwen3_moe", "gpt_oss"])
def test_a_value_no_model_has_is_refused_by_name(base, key, value, message):
    ModelConfig.from_hf(base)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig.from_hf({**base, key: value})


@pytest.mark.parametrize("key,value,message", BAD)
def test_the_text_config_of_a_multimodal_checkpoint_is_checked_the_same(key, value, message):
    hf = multimodal()
    text = hf["text_config"]
    (text["rope_parameters"] if key == "rope_theta" else text)[key] = value  # Qwen3.5 keeps the base there
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig.from_hf(hf)


def test_whole_floats_and_unset_optional_fields_still_load():
    cfg = ModelConfig.from_hf({**QWEN3, "num_hidden_layers": 2.0, "sliding_window": None})
    assert cfg.num_layers == 2 and isinstance(cfg.num_layers, int)
