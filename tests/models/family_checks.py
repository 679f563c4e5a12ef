"""Shared by the model-family tests: seeded token ids, and the packed-rows check every family must pass."""

from __future__ import annotations

from typing import Any

import numpy as np


def tokens_for(cfg: Any, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Seeded random token ids in `cfg`'s vocabulary."""
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, shape).astype(np.int32)


def assert_packed_rows_match_alone(model: Any, seqs: list[np.ndarray], width: int, atol: float = 1e-5) -> None:
    """`seqs` packed into one row of `width` (segments 1.., positions restarting, padding after) give each
    sequence's logits as it gives them alone: nothing leaks across a segment boundary."""
    tokens, segments, positions = (np.zeros((1, width), np.int32) for _ in range(3))
    starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
    for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        tokens[0, start : start + len(s)], segments[0, start : start + len(s)] = s, i + 1
        positions[0, start : start + len(s)] = np.arange(len(s))
    packed, _ = model(tokens, positions, segments)
    for s, start in zip(seqs, starts, strict=True):
        alone, _ = model(s[None])
        np.testing.assert_allclose(np.asarray(packed[0, start : start + len(s)]), np.asarray(alone[0]), atol=atol)


def assert_sharded_matches_one_device(model: Any, sharded: Any, tokens: np.ndarray) -> None:
    """A model laid out over a mesh gives one device's logits and parameter gradients (up to summation order)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    expected, _ = jax.jit(lambda t: model(t))(tokens)
    got, _ = jax.jit(lambda t: sharded(t))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)

    def loss(m: Any) -> Any:
        return jnp.sum(jnp.tanh(m(tokens)[0]))

    grads = [nnx.state(jax.jit(nnx.grad(loss))(m), nnx.Param) for m in (model, sharded)]
    for (path, mine), (_, want) in zip(nnx.to_flat_state(grads[1]), nnx.to_flat_state(grads[0]), strict=True):
        mine, want = np.asarray(mine.get_value()), np.asarray(want.get_value())
        assert np.abs(mine - want).max() <= 1e-4 * np.abs(want).max(), path
