"""Logits of our Flax models against transformers (torch CPU, float32) for every supported variant."""

import numpy as np
import pytest
import torch

from tx.models.weights import load_model

SPECS = [
    ("qwen3", 4, True, "default"),  # GQA ratio 1, tied
    ("qwen3", 2, False, "default"),  # GQA ratio 2, untied
    ("llama", 1, False, "llama3"),  # GQA ratio 4, Llama 3.1-style rope scaling
    ("llama", 2, True, "llama3"),
]


def reference_logits(torch_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parity
@pytest.mark.parametrize("family,kv_heads,tied,rope", SPECS)
def test_logits_match_transformers(hf_models, family, kv_heads, tied, rope):
    path, ref_model = hf_models(family, kv_heads, tied, rope)
    model, cfg = load_model(str(path), progress=False)
    assert cfg.num_kv_heads == kv_heads and cfg.tie_word_embeddings == tied
    # Positions past original_max_position_embeddings exercise the long-context rope branch.
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 48))
    ours, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(ours), reference_logits(ref_model, tokens), atol=1e-4, rtol=0)


ROPE_CORNERS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0},  # no pre-training length: the context's (256), not a default of 8192
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {"type": "yarn", "factor": 2.0, "beta_fast": 16.0, "truncate": False},  # an older config's spelling
    {"rope_type": "yarn", "factor": 4.0, "mscale": 0, "finetuned": True},  # keys transformers ignores
]


@pytest.mark.parity
@pytest.mark.parametrize("rope", ROPE_CORNERS, ids=lambda r: "-".join(k for k in r if k not in ("rope_type", "factor")))
def test_rope_scaling_corners_match_transformers(hf_models, tmp_path, rope):
    """The same weights under each rotary scaling, as transformers reads it: YaRN's explicit attention factor
    and mscales had been dropped (logits 2.3 off) and a missing pre-training length read as 8192 (7.2 off)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    source, _ = hf_models("llama", 2, False, "default")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, cfg = load_model(str(tmp_path), progress=False)
    tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (1, 200))
    ours, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(ours), reference_logits(reference, tokens), atol=1e-4, rtol=0)
