"""Merging an adapter into a HF checkpoint: the result loads as a plain transformers model with PEFT's logits."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")

# The tiny-model helpers live next door; pytest puts this folder on sys.path (tests/ has no __init__.py).
from test_peft import ATTN_MLP, build_base, load_base, logits, saved_peft, torch  # noqa: E402

from tx.lora.merge import merge_to_hf  # noqa: E402
from tx.lora.peft import load_peft  # noqa: E402

pytestmark = pytest.mark.parity


def adapter_for(base: Path, tmp: Path, **lora_kwargs):
    """A random PEFT adapter on `base`, saved and read back through `load_peft`."""
    model = saved_peft(tmp / "adapter", base, **lora_kwargs)
    config, weights = load_peft(tmp / "adapter")
    return model, config, weights


def tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize(
    ("family", "shard", "targets"),
    [("llama-untied", "100KB", ATTN_MLP + ["lm_head"]), ("qwen3-tied", None, ATTN_MLP)],
)
def test_merged_model_matches_merge_and_unload(tmp_path, family, shard, targets):
    base = build_base(tmp_path / "base", family, max_shard_size=shard)
    model, config, weights = adapter_for(base, tmp_path, target_modules=targets)
    merge_to_hf(base, tmp_path / "merged", config, weights)
    with torch.no_grad():
        expected = logits(model.merge_and_unload())
    np.testing.assert_allclose(logits(load_base(tmp_path / "merged")), expected, atol=1e-4, rtol=0)
    assert sorted(p.name for p in (tmp_path / "merged").glob("*.safetensors")) == sorted(
        p.name for p in base.glob("*.safetensors")
    )
    if shard:
        index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and index["weight_map"].keys() == tensors(base).keys()


def test_tied_lm_head_adapter_unties_the_merged_model(tmp_path):
    base = build_base(tmp_path / "base", "qwen3-tied", max_shard_size="100KB")
    model, config, weights = adapter_for(base, tmp_path)
    merge_to_hf(base, tmp_path / "merged", config, weights)
    # PEFT's merge_and_unload adds the lm_head delta to the shared embedding matrix, so compare against the
    # unmerged adapter: the semantics the adapter was trained with.
    np.testing.assert_allclose(logits(load_base(tmp_path / "merged")), logits(model), atol=1e-4, rtol=0)
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    merged, original = tensors(tmp_path / "merged"), tensors(base)
    assert "lm_head.weight" not in original and "lm_head.weight" in merged
    np.testing.assert_array_equal(merged["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["model.embed_tokens.weight"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())


def test_dtype_cast_and_side_files(tmp_path):
    import ml_dtypes

    base = build_base(tmp_path / "base", "llama-untied")
    (base / "tokenizer.json").write_text('{"fake": true}')
    (base / "chat_template.jinja").write_text("{{ messages }}")
    _, config, weights = adapter_for(base, tmp_path, target_modules=["q_proj", "down_proj"])
    merge_to_hf(base, tmp_path / "merged", config, weights, dtype="bfloat16")
    out = tmp_path / "merged"
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    merged, original = tensors(out), tensors(base)
    module = "model.layers.1.mlp.down_proj"
    a, b = weights[module]
    expected = (original[f"{module}.weight"] + config.scaling * (a @ b).T).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(merged[f"{module}.weight"], expected)
    assert all(t.dtype == ml_dtypes.bfloat16 for t in merged.values())
    assert load_base(out).lm_head.weight.dtype == torch.float32  # loads; upcast because load_base asks for fp32


def test_a_cast_merge_keeps_the_index_metadata_and_writes_every_dtype_field(tmp_path):
    """A sharded base's index metadata keeps the keys it had, with both totals recounted after the cast; the
    config's every dtype field (`torch_dtype` of older configs, a nested text_config's) names the new dtype:
    transformers reads whichever it finds first."""
    base = build_base(tmp_path / "base", "llama-untied", max_shard_size="100KB")
    index_path = base / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"] = {**index.get("metadata", {}), "total_parameters": 1, "format": "pt"}
    index_path.write_text(json.dumps(index))
    _, adapter, weights = adapter_for(base, tmp_path, target_modules=["q_proj"])
    config = json.loads((base / "config.json").read_text())  # as a multimodal config would write it
    config.pop("dtype", None)
    (base / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "text_config": {"dtype": "x"}}))
    merge_to_hf(base, tmp_path / "merged", adapter, weights, dtype="bfloat16")
    out = tmp_path / "merged"
    merged = tensors(out)
    metadata = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
    assert metadata["format"] == "pt" and metadata["total_size"] == sum(t.nbytes for t in merged.values())
    assert metadata["total_parameters"] == sum(t.size for t in merged.values())
    written = json.loads((out / "config.json").read_text())
    assert (written["dtype"], written["torch_dtype"], written["text_config"]["dtype"]) == ("bfloat16",) * 3


def test_unknown_module_fails_before_writing(tmp_path):
    base = build_base(tmp_path / "base", "llama-untied")
    _, config, weights = adapter_for(base, tmp_path, target_modules=["q_proj"])
    weights["model.layers.7.self_attn.q_proj"] = weights["model.layers.0.self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"model\.layers\.7\.self_attn\.q_proj"):
        merge_to_hf(base, tmp_path / "merged", config, weights)
    assert not (tmp_path / "merged").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]


def test_merge_command_uses_the_adapters_own_base(tmp_path, capsys):
    from tx.merge import main

    base = build_base(tmp_path / "base", "qwen3-tied")
    model, config, _ = adapter_for(base, tmp_path, target_modules=ATTN_MLP)
    assert Path(config.base_model_name_or_path) == base  # what peft recorded, and what the command resolves
    assert main([str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        expected = logits(model.merge_and_unload())
    np.testing.assert_allclose(logits(load_base(tmp_path / "merged")), expected, atol=1e-4, rtol=0)
    assert main([str(tmp_path / "missing"), str(tmp_path / "other")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "other").exists()
