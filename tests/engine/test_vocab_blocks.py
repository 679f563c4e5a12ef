"""Full-vocabulary work a block of positions at a time (`tx.engine.vocab_blocks`), and the training head
built on it (`train_step.head_logprobs`): the same values and gradients as all positions at once, in
scratch memory bounded by the block (the compiler's own account)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import TINY
from flax import nnx
from transformers import Qwen3Config

from tx.engine import train_step as ts
from tx.engine.losses import CONFIG_COLUMNS, LossInputs
from tx.engine.vocab_blocks import block_size, over_blocks
from tx.lora.params import AdapterRoles, LoRAParam
from tx.models.config import ModelConfig
from tx.models.weights import abstract_for


def test_block_size_is_the_largest_power_of_two_that_fits():
    assert block_size(rows=8, length=4096, vocab=1000, elements=8 * 1000 * 40) == 32
    assert block_size(rows=8, length=16, vocab=1000, elements=8 * 1000 * 40) == 16  # no more than needed
    assert block_size(rows=64, length=4096, vocab=151936, elements=1000) == 1  # always some progress
    assert block_size(rows=1, length=24, vocab=10, elements=160) == 16  # 24 is padded to two blocks


def test_blocks_give_what_all_positions_give_padding_included():
    """T = 24 in blocks of 16 (the last one padded): a pytree of outputs with trailing axes comes back
    as [R, T, ...], and gradients through checkpointed blocks are the whole function's."""
    rng = np.random.default_rng(0)
    x_RTD = jnp.asarray(rng.normal(size=(3, 24, 5)), jnp.float32)
    t_RT = jnp.asarray(rng.integers(0, 7, size=(3, 24)), jnp.int32)
    w_DV = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)

    def fn(x, t, w):
        logp = jax.nn.log_softmax(x @ w, axis=-1)
        return {"target": jnp.take_along_axis(logp, t[..., None], -1)[..., 0], "all": logp}

    whole = fn(x_RTD, t_RT, w_DV)
    blocked = over_blocks(lambda x, t: fn(x, t, w_DV), 16, x_RTD, t_RT)
    assert jax.tree.map(jnp.shape, blocked) == jax.tree.map(jnp.shape, whole)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), blocked, whole)

    def loss(x, w, blocks):
        f = jax.checkpoint(lambda x, t: fn(x, t, w)["target"])
        out = f(x, t_RT) if blocks is None else over_blocks(f, blocks, x, t_RT)
        return jnp.sum(jnp.sin(out) * jnp.arange(24.0))

    want = jax.grad(loss, argnums=(0, 1))(x_RTD, w_DV, None)
    got = jax.grad(loss, argnums=(0, 1))(x_RTD, w_DV, 16)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def grad_scratch_bytes(cfg: ModelConfig, R: int, T: int, logit_elements: int) -> int:
    """Scratch memory of a full-gradient step over R x T tokens (shapes only: nothing runs)."""
    graphdef, lora, base = nnx.split(abstract_for(cfg, None, remat=False), LoRAParam, ...)
    steps = ts.StepFunctions(graphdef, AdapterRoles(frozenset(), frozenset()), logit_elements)
    N, D = R * T, 1
    spec = jax.ShapeDtypeStruct
    loss = LossInputs(
        spec((N,), jnp.int32), spec((N,), jnp.bool_), spec((N, 1), jnp.float32), *[spec((N,), jnp.float32)] * 3,
        spec((D,), jnp.int32), spec((D, len(CONFIG_COLUMNS)), jnp.float32), spec((D,), jnp.bool_),
    )  # fmt: skip
    ints = spec((R, T), jnp.int32)
    batch = ts.TrainBatch(ints, ints, ints, spec((R, T, 1), jnp.int32), None, loss)
    lowered = steps.full_grad.lower(ts.flat(base), ts.flat(lora), batch)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_a_training_step_over_a_large_vocabulary_takes_bounded_scratch_memory():
    """4 rows of 2048 tokens over a 32k vocabulary: their logits at once are 1 GiB of scratch (the gradient
    reuses their buffer). In blocks of at most 2^22 logits (16 MiB) the step needs a few blocks' worth."""
    hf = Qwen3Config(**{**TINY, "vocab_size": 32768}, num_key_value_heads=2, tie_word_embeddings=True)
    cfg = ModelConfig.from_hf({**hf.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    R, T = 4, 2048
    whole = grad_scratch_bytes(cfg, R, T, logit_elements=R * T * cfg.vocab_size)
    blocked = grad_scratch_bytes(cfg, R, T, logit_elements=1 << 22)
    assert R * T * cfg.vocab_size * 4 == 1 << 30
    assert whole >= 1 << 30, whole / 2**20
    assert blocked <= 4 * (4 << 22), blocked / 2**20
