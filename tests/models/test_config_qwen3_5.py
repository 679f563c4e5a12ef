"""Qwen3.5 config.json parsing: both checkpoint classes, every unknown or unsupported field rejected."""

import copy

import pytest

from tx.models.config import ModelConfig

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "full_attention_interval": 4,
    "attn_output_gate": True,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "dtype": "bfloat16",
}

TEXT_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2


def causal() -> dict:
    return {"architectures": ["Qwen3_5ForCausalLM"], **copy.deepcopy(TEXT), "tie_word_embeddings": True}


def multimodal() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**copy.deepcopy(TEXT), "tie_word_embeddings": False},
        "vision_config": {"depth": 1, "hidden_size": 16, "anything": "the vision tower is not loaded"},
        "image_token_id": 5,
        "tie_word_embeddings": True,
    }


@pytest.mark.parametrize("hf,prefix", [(causal(), "model"), (multimodal(), "model.language_model")])
def test_both_checkpoint_classes_give_the_same_text_model(hf, prefix):
    cfg = ModelConfig.from_hf(hf)
    assert cfg.family == "qwen3_5" and cfg.checkpoint_prefix == prefix and cfg.dtype == "bfloat16"
    assert cfg.kinds == tuple(TEXT_LAYERS)
    assert cfg.linear is not None and cfg.linear.conv_dim == 2 * 2 * 8 + 4 * 6
    assert cfg.rotary_dim == 2 and cfg.rope_theta == 1e7 and cfg.tie_word_embeddings  # the wrapper's flag ties
    assert cfg.layers_holding("self_attn") == (3, 7) and cfg.layers_holding("mlp") == tuple(range(8))


def moe_layer(text: dict) -> None:
    text.pop("full_attention_interval")
    text["layer_types"] = TEXT_LAYERS[:-1] + ["moe"]


def interval_disagrees(text: dict) -> None:
    text.update(full_attention_interval=2, layer_types=TEXT_LAYERS)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.update(sliding_window=128), r"not support.*\['sliding_window'\]"),
        (lambda t: t.update(attn_output_gate=False), "attn_output_gate=False"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda t: t["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
        (lambda t: t["rope_parameters"].update(factor=2.0), r"rope_parameters.*\['factor'\]"),
        (moe_layer, "layer_types.*moe"),
        (interval_disagrees, "disagrees with full_attention_interval"),
        (lambda t: t.update(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    ],
)
def test_unsupported_text_fields_are_rejected_by_name(edit, message):
    for hf in (causal(), multimodal()):
        edit(hf.get("text_config", hf))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf(hf)


def test_unknown_wrapper_field_is_rejected():
    hf = multimodal()
    hf["audio_config"] = {}
    with pytest.raises(ValueError, match=r"\['audio_config'\]"):
        ModelConfig.from_hf(hf)
