"""Config validation and weight-loading errors name what is wrong."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tx.models.config import ModelConfig, load_hf_config
from tx.models.weights import load_model


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_lists_supported(hf_models, tmp_path):
    path = copy_model(hf_models()[0], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_hf_config(path)


def test_a_config_without_architectures_or_not_json_says_so(hf_models, tmp_path):
    """A config with no `architectures` read as "unsupported architecture qwen3" (a supported one); broken
    JSON gave the parser's message without the file's name."""
    path = copy_model(hf_models()[0], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["architectures"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r'names no architectures \(model_type .qwen3.\).*"Qwen3ForCausalLM"'):
        load_hf_config(path)
    (path / "config.json").write_text("{'model_type': 'qwen3'}")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_hf_config(path)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(
            "qwen3",
            10,
            8,
            8,
            1,
            num_heads=4,
            num_kv_heads=3,
            head_dim=2,
            rms_norm_eps=1e-6,
            rope_theta=1e4,
            max_position_embeddings=8,
            tie_word_embeddings=True,
        )


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor must be a finite number > 0, got nan"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0}, "low_freq_factor must be a finite"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}, "must be below high_freq_factor"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_slow": float("inf")}, "beta_slow must be a finite"),
    ],
)
def test_rope_scaling_that_would_break_the_first_forward_is_refused(fields, message):
    """NaN passed `factor <= 0` (every logit NaN); a zero low_freq_factor or original length divided by zero
    at the first forward, after the model had loaded: refused when the config is read, naming the field."""
    from tx.models.config_rope import RopeScaling

    with pytest.raises(ValueError, match=message):
        RopeScaling(**fields)


def test_a_rotary_dim_past_the_head_dim_is_refused():
    """partial_rotary_factor > 1 made the rotary dims wider than the head: a shape error at the first forward."""
    fields = dict(num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8,
                  tie_word_embeddings=True)  # fmt: skip
    ModelConfig("qwen3", 10, 8, 8, 1, **fields, partial_rotary_factor=1.0)
    with pytest.raises(ValueError, match="partial_rotary_factor 2.0 gives rotary dim 8"):
        ModelConfig("qwen3", 10, 8, 8, 1, **fields, partial_rotary_factor=2.0)


@pytest.mark.parametrize(
    "edit,message",
    [
        ("drop", "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        ("extra", "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
        ("shape", r"tensor 'model.norm.weight' has shape \(3,\), expected \(64,\)"),
    ],
)
def test_bad_checkpoint_names_the_tensor(hf_models, tmp_path, edit, message):
    path = copy_model(hf_models()[0], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    if edit == "drop":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    elif edit == "extra":
        tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    else:
        tensors["model.norm.weight"] = np.zeros((3,), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_model(str(path), progress=False)


def test_sharded_bfloat16_checkpoint(hf_models, tmp_path):
    """A sharded bf16 checkpoint loads shard by shard into bf16 weights with the same values."""
    import copy

    import torch

    _, ref = hf_models()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref16.save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    model, cfg = load_model(str(tmp_path / "bf16"), progress=False)
    assert cfg.dtype == "bfloat16" and model.model.layers.mlp.up_proj.weight[...].dtype == np.dtype("bfloat16")
    want = ref16.model.layers[1].mlp.up_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(model.model.layers.mlp.up_proj.weight[...][1], np.float32), want)


def test_a_shard_index_naming_a_file_outside_its_directory_is_refused(hf_models, tmp_path):
    """Only uploads had their index checked: a local or hub directory whose index named an absolute path or
    `../` read any safetensors file on the server (another repo's cached weights, say) into the model."""
    from tx.models.safetensors_io import shard_files

    _, ref = hf_models()
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index_path = tmp_path / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    assert shard_files(tmp_path / "sharded")
    for outside in (str(tmp_path / "elsewhere.safetensors"), "../elsewhere.safetensors", "sub/x.safetensors"):
        index["weight_map"][first] = outside
        index_path.write_text(json.dumps(index))
        with pytest.raises(ValueError, match="shards are files beside it"):
            shard_files(tmp_path / "sharded")
        with pytest.raises(ValueError, match="shards are files beside it"):
            load_model(str(tmp_path / "sharded"), progress=False)


def test_missing_directory_and_offline_hub():
    with pytest.raises(FileNotFoundError, match="local"):
        load_model("no-such-org/no-such-model", progress=False)


def test_save_hf_writes_the_checkpoint_back(hf_models, tmp_path):
    """`save_hf` gives every tensor back exactly as the checkpoint stores it (untied lm_head included), so
    exported full fine-tuning weights load in transformers."""
    from flax import nnx

    from tx.models.weights import save_hf

    path, _ = hf_models("llama", 2, False)
    model, cfg = load_model(str(path), progress=False)
    params = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    save_hf(params, cfg, path, tmp_path / "out")
    original, written = (
        load_file(str(path / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert set(written) == set(original) and "lm_head.weight" in written
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
