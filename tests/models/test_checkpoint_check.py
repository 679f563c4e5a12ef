"""`check_checkpoint` from the headers alone: every checkpoint the loader reads passes (dense, untied,
sharded bf16, Qwen3.5 with its vision tower skipped, Qwen3-MoE per-expert tensors), and every way a
checkpoint can fail to load is named before any weight is read, and the loader refuses the same."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import build_qwen3_5
from safetensors.numpy import load_file, save_file

from tx.models.checkpoint_check import check_checkpoint
from tx.models.weights import load_model


@pytest.fixture(scope="module")
def sharded(hf_models, tmp_path_factory) -> Path:
    """The untied Llama saved by transformers in bf16 shards, with its index."""
    import copy

    import torch

    _, ref = hf_models("llama", 2, False)
    out = tmp_path_factory.mktemp("sharded") / "m"
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(out, max_shard_size="40KB")
    return out


def test_checkpoints_that_load_pass(hf_models, sharded, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    assert check_checkpoint(hf_models()[0]).family == "qwen3"
    assert check_checkpoint(sharded).dtype == "bfloat16"
    build_qwen3_5(tmp_path / "q35", multimodal=True)
    assert check_checkpoint(tmp_path / "q35").checkpoint_prefix == "model.language_model"
    moe = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**moe)).save_pretrained(tmp_path / "moe")
    assert check_checkpoint(tmp_path / "moe").moe is not None


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def header_length_past_the_end(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10**9) + f.read_bytes()[8:])


def a_header_nested_past_the_stack(d: Path) -> None:  # json.loads raised RecursionError: a 500 at upload
    header = b"[" * 100_000 + b"]" * 100_000
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + f.read_bytes())


def cut_the_data(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])


def integer_weights(d: Path) -> None:
    rewrite(d / "model.safetensors", lambda t: t.update({"model.norm.weight": np.zeros(64, np.int32)}))


def wrong_shape(d: Path) -> None:
    rewrite(d / "model.safetensors", lambda t: t.update({"model.norm.weight": np.zeros(63, np.float32)}))


def extra_tensor(d: Path) -> None:
    rewrite(d / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(2, np.float32)}))


def missing_tensor(d: Path) -> None:
    rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def layer_past_the_end(d: Path) -> None:
    rewrite(
        d / "model.safetensors",
        lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((128, 64), np.float32)}),
    )


def a_thousand_layers(d: Path) -> None:  # within the config's own bound (1024), over a two-layer checkpoint
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1000}))


def unsupported_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))


@pytest.mark.parametrize(
    "spoil,message",
    [
        (header_length_past_the_end, r"model.safetensors is truncated or not safetensors: header of 1000000000 bytes"),
        (a_header_nested_past_the_stack, r"model.safetensors: header is not JSON \(RecursionError"),
        (cut_the_data, r"model.safetensors is truncated: tensor '.*' ends at data byte \d+, the file holds \d+"),
        (
            integer_weights,
            r"tensor 'model.norm.weight' in model.safetensors has dtype int32; base weights must be",
        ),
        (wrong_shape, r"tensor 'model.norm.weight' has shape \(63,\), expected \(64,\)"),
        (extra_tensor, r"unexpected tensor 'model.layers.0.mlp.extra.weight'"),
        (missing_tensor, r"missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        (layer_past_the_end, r"unexpected tensor 'model.layers.2.mlp.up_proj.weight': layer 2 has no mlp"),
        (
            unsupported_architecture,
            r"unsupported architecture \['GPT2LMHeadModel'\]; supported: \[.*'LlamaForCausalLM'",
        ),
    ],
)
def test_a_checkpoint_that_cannot_load_is_named_before_loading(hf_models, tmp_path, spoil, message):
    path = Path(shutil.copytree(hf_models()[0], tmp_path / "m"))
    spoil(path)
    with pytest.raises(ValueError, match=message):
        check_checkpoint(path)
    with pytest.raises(ValueError):  # the loader agrees: the check never passes what cannot load
        load_model(str(path), progress=False)


def test_a_config_larger_than_its_weights_is_refused_before_anything_is_counted_per_layer(hf_models, tmp_path):
    """A hostile config (a thousand layers over a two-layer checkpoint; a million is refused by the config's own
    bounds) is refused by size at once; the loader would allocate the stacked weights before finding the layers
    missing."""
    path = Path(shutil.copytree(hf_models()[0], tmp_path / "m"))
    a_thousand_layers(path)
    with pytest.raises(ValueError, match=r"describes \d+ weights, at least \d+ bytes as stored, but the safetensors"):
        check_checkpoint(path)


def spoil_index(d: Path, edit) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    edit(index["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update({"model.norm.weight": "../outside.safetensors"}), r"names shard '../outside.safetensors'"),
        (lambda m: m.pop("model.norm.weight"), r"tensor 'model.norm.weight' in model-\d+-of-\d+.safetensors is not in"),
        (lambda m: m.update({k: "model-00001-of-99.safetensors" for k in list(m)[:1]}), r"is not in the directory"),
        (lambda m: m.clear(), r"has no weight_map object"),
    ],
)
def test_a_sharded_index_names_exactly_its_shards(sharded, tmp_path, edit, message):
    path = Path(shutil.copytree(sharded, tmp_path / "m"))
    (tmp_path / "outside.safetensors").write_bytes(b"")
    spoil_index(path, edit)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_checkpoint(path)


def test_a_tensor_stored_in_two_shards_is_refused(sharded, tmp_path):
    path = Path(shutil.copytree(sharded, tmp_path / "m"))
    first, second = sorted(path.glob("model-*.safetensors"))[:2]
    twice = next(iter(load_file(first)))
    rewrite(second, lambda t: t.update({twice: load_file(first)[twice]}))
    with pytest.raises(ValueError, match=f"tensor '{twice}' is stored twice"):
        check_checkpoint(path)
