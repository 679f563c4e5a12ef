"""Prompt scores in bounded memory: the prefill builds full-vocabulary logits a block of positions at a
time, so its scratch memory does not grow with rows x length x vocabulary (the compiler's own account)."""

import jax
import jax.numpy as jnp
from conftest import TINY
from flax import nnx
from transformers import Qwen3Config

from tx.engine.decode_steps import SCORE_ELEMENTS, DecodePrograms, PrefillBatch
from tx.models.config import ModelConfig
from tx.models.weights import abstract_for


def scratch_bytes(programs: DecodePrograms, state: nnx.State, N: int, P: int, scores: bool) -> int:
    ints = jax.ShapeDtypeStruct((N, P), jnp.int32)
    lowered = programs.prefill.lower(state, None, PrefillBatch(ints, ints, ints), scores=scores, topk=4 * scores)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_prompt_scores_take_bounded_scratch_memory():
    """8 prompts of 2048 positions over a 32k vocabulary: their logits at once are 2 GiB (and the
    log-softmax as much again); scoring them adds at most a few blocks' worth to the plain prefill, far
    below a quarter of that."""
    hf = Qwen3Config(**{**TINY, "vocab_size": 32768}, num_key_value_heads=2, tie_word_embeddings=True)
    cfg = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    graphdef, state = nnx.split(abstract_for(cfg, None, remat=False))
    programs = DecodePrograms(graphdef, chunk_steps=4, k_cap=8)
    N, P = 8, 2048
    extra = scratch_bytes(programs, state, N, P, scores=True) - scratch_bytes(programs, state, N, P, scores=False)
    assert N * P * cfg.vocab_size * 4 == 2 << 30
    assert extra <= min(3 * 4 * SCORE_ELEMENTS, 512 << 20), extra / 2**20
