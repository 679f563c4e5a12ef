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
