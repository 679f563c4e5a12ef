"""The MoE block alone: with a shared expert against transformers' Qwen3.5-MoE block (outputs and
gradients, each form), and the expert-product forms against each other when an expert gets no token."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tx.models.config import ModelConfig, MoE
from tx.models.grouped import block_product, permute_rows
from tx.models.moe import (
    Routing,
    SparseMoeBlock,
    block_rows,
    blocked_experts,
    blocks_of,
    dense_experts,
    pair_experts,
    ragged_experts,
)
from tx.tuning import CPU

D, F, SHARED, X, K = 16, 8, 12, 4, 2


def config() -> ModelConfig:
    moe = MoE(experts=X, top_k=K, expert_size=F, norm_topk_prob=True, sparse_layers=(0,), shared_expert_size=SHARED)
    return ModelConfig(
        "qwen3_moe", vocab_size=8, hidden_size=D, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8, tie_word_embeddings=False, moe=moe,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf = Qwen3_5MoeTextConfig(
        hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=SHARED, num_experts=X,
        num_experts_per_tok=K,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3_5MoeSparseMoeBlock(hf)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block


def ours(reference, form_max: int, block_rows: int = 128) -> SparseMoeBlock:
    """Our block with the reference's weights; `form_max`, `block_rows`: `Tuning.moe_dense_max_experts`,
    `Tuning.moe_block_rows`."""
    tuning = dataclasses.replace(CPU, moe_dense_max_experts=form_max, moe_block_rows=block_rows)
    block = SparseMoeBlock(config(), None, (), tuning)
    w = {name: jnp.asarray(p.detach().numpy()) for name, p in reference.named_parameters()}
    block.gate.weight.set_value(w["gate.weight"])
    block.experts.gate_proj.weight.set_value(w["experts.gate_up_proj"][:, :F])
    block.experts.up_proj.weight.set_value(w["experts.gate_up_proj"][:, F:])
    block.experts.down_proj.weight.set_value(w["experts.down_proj"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(block.shared_expert, name).weight.set_value(w[f"shared_expert.{name}.weight"])
    block.shared_expert_gate.weight.set_value(w["shared_expert_gate.weight"])
    return block


@pytest.mark.parity
@pytest.mark.parametrize("form_max, rows, form", [(0, 0, "ragged"), (X, 0, "dense"), (X, 2, "blocked")])
def test_shared_expert_block_matches_transformers(reference, form_max, rows, form):
    block = ours(reference, form_max, rows)
    assert block.form_for(10)[0] == form
    x = np.random.RandomState(0).randn(2, 5, D).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    want = reference(xt)
    np.testing.assert_allclose(np.asarray(block(jnp.asarray(x), None)), want.detach().numpy(), atol=1e-4, rtol=0)
    reference.zero_grad()
    torch.sum(torch.tanh(want)).backward()
    graph, params = nnx.split(block, nnx.Param)
    dx, grads = jax.grad(lambda x, p: jnp.sum(jnp.tanh(nnx.merge(graph, p)(x, None))), argnums=(0, 1))(x, params)
    np.testing.assert_allclose(np.asarray(dx), xt.grad.numpy(), atol=1e-4, rtol=0)
    g = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    torch_grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    gate_up = np.concatenate([g["experts.gate_proj.weight"], g["experts.up_proj.weight"]], axis=1)
    np.testing.assert_allclose(gate_up, torch_grads.pop("experts.gate_up_proj"), atol=1e-4, rtol=0)
    np.testing.assert_allclose(g["experts.down_proj.weight"], torch_grads.pop("experts.down_proj"), atol=1e-4, rtol=0)
    for name, want_grad in torch_grads.items():
        np.testing.assert_allclose(g[name], want_grad, atol=1e-4, rtol=0, err_msg=name)


def test_forms_agree_when_an_expert_gets_no_token():
    """Expert 2 is never chosen (an empty ragged group); gradients of the inputs and every expert agree."""
    rng = np.random.RandomState(1)
    N = 9
    x = jnp.asarray(rng.randn(N, D), jnp.float32)
    choices = np.array([[0, 1], [3, 0], [1, 3]] * 3, np.int32)
    routing = Routing(jnp.asarray(choices), jnp.asarray(rng.rand(N, K), jnp.float32))
    gate, up = (jnp.asarray(rng.randn(X, F, D) / np.sqrt(D), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(X, D, F) / np.sqrt(F), jnp.float32)

    def grads(product):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(product(a[0], routing, *a[1:]))), argnums=(0, 1, 2, 3))(
            x, gate, up, down
        )

    want = dense_experts(x, routing, gate, up, down)
    blocked = [functools.partial(blocked_experts, rows=rows) for rows in (1, 2, 4, 32)]  # 32: one block each
    for product in (ragged_experts, pair_experts, *blocked):
        np.testing.assert_allclose(product(x, routing, gate, up, down), want, atol=1e-4)
        for mine, want_grad in zip(grads(product), grads(dense_experts), strict=True):
            np.testing.assert_allclose(mine, want_grad, atol=1e-5, rtol=0)
        assert not np.any(np.asarray(grads(product)[1][2]))  # the unused expert gets no gradient


def test_blocks_hold_each_experts_pairs_in_whole_blocks():
    """The layout itself: every pair in one padded row, each block one expert's, its padding marked."""
    flat = jnp.asarray([2, 0, 2, 2, 1, 0, 2], jnp.int32)  # expert 3 gets none
    layout = blocks_of(flat, 4, 2)
    assert layout.pair.shape == (block_rows(7, 4, 2),) == (12,)  # 7 pairs + up to 1 padding row per expert
    pair, at, expert = (np.asarray(v) for v in (layout.pair, layout.at, layout.expert))
    np.testing.assert_array_equal(pair[at], np.arange(7))
    np.testing.assert_array_equal(pair, [1, 5, 4, 7, 0, 2, 3, 6, 7, 7, 7, 7])
    np.testing.assert_array_equal(expert, [0, 1, 2, 2, 3, 3])  # the unused blocks: any expert, rows all padding
    assert int(layout.used) == 4  # the blocks after the first 4 hold only padding
    np.testing.assert_array_equal(np.asarray(flat)[pair[pair < 7]], np.repeat(expert, 2)[pair < 7])


def test_the_block_product_and_its_backward_match_autodiff_of_gathered_weights():
    """`block_product` (a loop that reads each block's expert weight in place, with its own backward) against
    the batched product with per-block weight copies and its autodiff: the same outputs and gradients on the
    used blocks, zeros on the padding blocks after them, and no gradient from them."""
    rng = np.random.RandomState(3)
    blocks = jnp.asarray(rng.randn(5, 3, 4), jnp.float32)  # 5 blocks of 3 rows, in = 4
    weight = jnp.asarray(rng.randn(2, 6, 4), jnp.float32)  # 2 experts, out = 6
    expert, used = jnp.asarray([0, 1, 1, 1, 1], jnp.int32), jnp.asarray(3, jnp.int32)
    live = (np.arange(5) < 3)[:, None, None]

    def reference(blocks: jax.Array, weight: jax.Array) -> jax.Array:
        return jnp.einsum("bni,boi->bno", blocks, jnp.take(weight, expert, axis=0)) * live

    def loss(product):
        return lambda b, w: jnp.sum(jnp.sin(product(b, w)))

    mine = block_product(blocks, weight, expert, used)
    np.testing.assert_allclose(mine, reference(blocks, weight), atol=1e-5)
    assert not np.any(np.asarray(mine)[3:])
    got = jax.grad(loss(lambda b, w: block_product(b, w, expert, used)), argnums=(0, 1))(blocks, weight)
    want = jax.grad(loss(reference), argnums=(0, 1))(blocks, weight)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    assert not np.any(np.asarray(got[0])[3:])


def test_permute_rows_backward_is_the_inverse_move():
    """`permute_rows` and its backward (a gather the other way) against `jnp.take`'s scatter-add gradient."""
    src = jnp.asarray(np.random.RandomState(4).randn(3, 2), jnp.float32)
    index, inverse = jnp.asarray([1, 3, 2, 0], jnp.int32), jnp.asarray([3, 0, 2], jnp.int32)  # 3: a zero row
    want_rows = np.asarray(src)[[1, 0, 2, 0]] * [[1], [0], [1], [1]]
    np.testing.assert_array_equal(permute_rows(src, index, inverse), want_rows)
    weights = jnp.arange(8.0).reshape(4, 2)

    def taken(s: jax.Array) -> jax.Array:
        return jnp.take(jnp.concatenate([s, jnp.zeros((1, 2))]), index, axis=0)

    got = jax.grad(lambda s: jnp.sum(permute_rows(s, index, inverse) * weights))(src)
    np.testing.assert_array_equal(got, jax.grad(lambda s: jnp.sum(taken(s) * weights))(src))


def test_the_blocked_form_runs_where_it_computes_fewer_rows(reference):
    """With blocks of 128 rows, 4 experts of top-2: calls of at most X pairs (1 or 2 tokens) run each pair on
    its own (only the chosen experts read), a few more tokens stay dense (blocks would pad more rows than
    dense computes), long prefills go blocked."""
    block = ours(reference, X)
    assert block.block == 128 and block.form_for(1) == ("pairs", 1) and block.form_for(2) == ("pairs", 1)
    assert block.form_for(3) == ("dense", 128)  # 6 pairs: more than X
    assert block.form_for(32) == ("dense", 128) and block.form_for(2048) == ("blocked", 128)
    assert block_rows(2048 * K, X, 128) < 2048 * X and block_rows(32 * K, X, 128) >= 32 * X
