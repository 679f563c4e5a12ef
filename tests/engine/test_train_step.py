"""The small training programs on their own: which buffers each donates, AdamW with clipping against torch,
and the per-run slot slices, on a few tiny arrays (no model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tx.engine import train_step as ts
from tx.lora.params import AdapterRoles

M_ROLES = AdapterRoles(frozenset({("m", "lora_a")}), frozenset({("m", "lora_b")}))
Q_ROLES = AdapterRoles(frozenset({("q", "lora_a")}), frozenset({("q", "lora_b")}))


def donated(jitted, *args) -> list[list[bool]]:  # type: ignore[no-untyped-def]
    """Per positional argument, whether each of its leaves is donated (from the lowered program, no compile)."""
    return [[leaf.donated for leaf in jax.tree.leaves(arg)] for arg in jitted.lower(*args).args_info[0]]


def test_each_program_donates_exactly_the_buffers_it_replaces() -> None:
    """The accumulator, the adapter stack and the AdamW state are replaced in place; gradients of a fused batch
    are read again for the next run's slice, and hyper-parameters are the caller's: neither may be donated
    (on an accelerator a donated gradient is freed before the next run reads it)."""
    acc = {("m", "lora_a"): jnp.zeros((3, 2)), ("m", "lora_b"): jnp.zeros((2, 5))}
    grads = {("m", "lora_a"): jnp.ones((4, 3, 2)), ("m", "lora_b"): jnp.ones((4, 2, 5))}
    slot = jnp.int32(1)
    assert donated(ts.accumulate_slot, acc, grads, slot, M_ROLES) == [[True, True], [False, False], [False]]
    assert donated(ts.accumulate_full, acc, acc) == [[True, True], [False, False]]
    assert donated(ts.write_slot_params, grads, slot, acc, M_ROLES) == [[True, True], [False], [False, False]]
    params = {("w",): jnp.ones((3,))}
    _, opt_state = ts.fresh_state(params)
    hp = {k: jnp.float32(0.1) for k in ("learning_rate", "b1", "b2", "eps", "weight_decay", "grad_clip_norm")}
    flags = donated(ts.adam_step, params, opt_state, params, hp)
    assert [all(f) for f in flags[:3]] == [True, True, True] and not any(flags[3])


@pytest.mark.parametrize("clip", [0.0, 0.3, 0.6, 2.0])
def test_adam_step_clips_the_global_norm_then_steps_like_torch(clip: float) -> None:
    """Gradients of global norm 0.5 (below 1, where a floor on the divisor would show) clipped to 0.3, not
    clipped by 0.6 or 2.0, or clip 0 (off); then AdamW with weight decay, against torch's clip_grad_norm_
    and AdamW. The reported norm is the pre-clip one."""
    rng = np.random.default_rng(0)
    params_np = {("a",): rng.normal(size=(3, 4)).astype(np.float32), ("b",): rng.normal(size=(5,)).astype(np.float32)}
    grads_np = {p: rng.normal(size=v.shape).astype(np.float32) for p, v in params_np.items()}
    scale = 0.5 / np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads_np.values()))
    grads_np = {p: (g * scale).astype(np.float32) for p, g in grads_np.items()}
    hp = dict(learning_rate=0.1, b1=0.8, b2=0.9, eps=1e-3, weight_decay=0.2, grad_clip_norm=clip)
    params = {p: jnp.asarray(v) for p, v in params_np.items()}
    grads, opt_state = ts.fresh_state(params)
    grads = {p: jnp.asarray(v) for p, v in grads_np.items()}
    new, _, zeroed, norm, applied = ts.adam_step(params, opt_state, grads, {k: jnp.float32(v) for k, v in hp.items()})
    assert bool(applied)

    tensors = [torch.tensor(params_np[p], requires_grad=True) for p in sorted(params_np)]
    for tensor, p in zip(tensors, sorted(params_np), strict=True):
        tensor.grad = torch.tensor(grads_np[p])
    ref_norm = torch.nn.utils.clip_grad_norm_(tensors, clip if clip > 0 else float("inf")).item()
    opt = torch.optim.AdamW(tensors, lr=0.1, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.2)
    opt.step()
    assert float(norm) == pytest.approx(ref_norm, rel=1e-6) and ref_norm == pytest.approx(0.5, rel=1e-5)
    for tensor, p in zip(tensors, sorted(params_np), strict=True):
        np.testing.assert_allclose(np.asarray(new[p]), tensor.detach().numpy(), rtol=0, atol=1e-6)
    assert all(not np.asarray(g).any() for g in zeroed.values())


def test_bfloat16_weights_take_updates_smaller_than_their_step_on_average() -> None:
    """Full fine-tuning in bfloat16: an AdamW update of 1e-4 on weights of 1.0 (a bfloat16 step there is
    2^-7) rounded to nearest was lost every time, so the weights never moved. Rounded stochastically, 50
    steps move them by 50 updates on average, the same on every call; float32 weights step exactly."""
    hp = {k: jnp.float32(v) for k, v in dict(learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                              grad_clip_norm=0.0).items()}  # fmt: skip

    def run(steps: int) -> dict:  # fresh inputs each time: the step donates its buffers
        weights = {("w",): jnp.ones(8192, jnp.bfloat16), ("f",): jnp.ones(4, jnp.float32)}
        _, state = ts.fresh_state(weights, jnp.float32)
        for _ in range(steps):
            ones = {p: jnp.ones(v.shape, jnp.float32) for p, v in weights.items()}
            weights, state, _, _, applied = ts.adam_step(weights, state, ones, hp)
            assert bool(applied)
        return weights

    moved = run(50)
    w = np.asarray(moved[("w",)], np.float32)
    assert abs(w.mean() - (1 - 50e-4)) < 3e-4, w.mean()  # each update is lr: the gradient is constant
    np.testing.assert_allclose(np.asarray(moved[("f",)]), 1 - 50e-4, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(run(50)[("w",)], np.float32), w)
    odd_nan = jax.lax.bitcast_convert_type(jnp.uint32(0x7FFFFFFF), jnp.float32)  # all payload bits set
    rounded = ts._rounded(jnp.stack([odd_nan, jnp.inf]), jnp.bfloat16, jax.random.key(0), 0)
    assert np.isnan(np.float32(rounded[0])) and np.isinf(np.float32(rounded[1])), rounded


def test_a_runs_slot_slice_is_read_written_and_accumulated_at_its_rank() -> None:
    """A stacked adapter [S=3 slots, in=4, R=4] / [S, R, out=2] holding rank 2 in slot 1: the run reads and
    writes only its slot's first two rank components, and accumulates only its slice of a compact gradient."""
    rng = np.random.default_rng(1)
    a_path, b_path = ("q", "lora_a"), ("q", "lora_b")
    stack = {a_path: jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32),
             b_path: jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)}  # fmt: skip
    like = {a_path: jnp.zeros((4, 2)), b_path: jnp.zeros((2, 2))}
    slot = jnp.int32(1)
    read = ts.read_slot_params(stack, slot, like, Q_ROLES)
    np.testing.assert_array_equal(read[a_path], np.asarray(stack[a_path])[1, :, :2])
    np.testing.assert_array_equal(read[b_path], np.asarray(stack[b_path])[1, :2, :])
    before = {p: np.asarray(v) for p, v in stack.items()}
    new = {a_path: jnp.full((4, 2), 7.0), b_path: jnp.full((2, 2), 9.0)}
    written = ts.write_slot_params(stack, slot, new, Q_ROLES)
    a, b = np.asarray(written[a_path]), np.asarray(written[b_path])
    assert (a[1, :, :2] == 7).all() and (a[1, :, 2:] == 0).all() and (b[1, :2] == 9).all() and (b[1, 2:] == 0).all()
    for other in (0, 2):  # other slots untouched
        np.testing.assert_array_equal(a[other], before[a_path][other])
        np.testing.assert_array_equal(b[other], before[b_path][other])
    grads = {a_path: jnp.asarray(rng.normal(size=(2, 4, 4)), jnp.float32),
             b_path: jnp.asarray(rng.normal(size=(2, 4, 2)), jnp.float32)}  # fmt: skip
    acc = {a_path: jnp.ones((4, 2)), b_path: jnp.ones((2, 2))}
    out = ts.accumulate_slot(acc, grads, jnp.int32(1), Q_ROLES)
    np.testing.assert_allclose(out[a_path], 1 + np.asarray(grads[a_path])[1, :, :2], rtol=1e-6)
    np.testing.assert_allclose(out[b_path], 1 + np.asarray(grads[b_path])[1, :2, :], rtol=1e-6)
    full = ts.accumulate_full({a_path: jnp.ones((4, 2))}, {a_path: jnp.full((4, 2), 2.0, jnp.bfloat16)})
    assert full[a_path].dtype == jnp.float32 and (np.asarray(full[a_path]) == 3).all()


def test_fresh_state_keeps_gradients_in_the_params_dtype_unless_told_and_moments_in_fp32() -> None:
    params = {("w",): jnp.ones((3,), jnp.bfloat16), ("v",): jnp.ones((2,), jnp.float32)}
    grads, opt_state = ts.fresh_state(params)
    assert {p: g.dtype for p, g in grads.items()} == {("w",): jnp.bfloat16, ("v",): jnp.float32}
    grads, _ = ts.fresh_state(params, jnp.float32)
    assert {g.dtype for g in grads.values()} == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}


def test_stacks_with_a_layer_axis_are_resized_and_written_along_their_rank_axis_only() -> None:
    """Stacks [L=2, S=3, in=5, R=4] / [L, S, R, out=6], as a scanned model holds them: cut to 2 or zero-padded to
    8 rank columns, and one slot's [L, in, 3] / [L, 3, out] adapter written zero-padded to the stacks' rank
    (every size distinct, so a wrong axis cannot pass)."""
    rng = np.random.default_rng(2)
    a_path, b_path = ("q", "lora_a"), ("q", "lora_b")
    a, b = rng.normal(size=(2, 3, 5, 4)).astype(np.float32), rng.normal(size=(2, 3, 4, 6)).astype(np.float32)
    stack = {a_path: jnp.asarray(a), b_path: jnp.asarray(b)}
    cut = ts.resize_stacks(stack, 2, Q_ROLES)
    np.testing.assert_array_equal(cut[a_path], a[..., :2])
    np.testing.assert_array_equal(cut[b_path], b[..., :2, :])
    wide = ts.resize_stacks(stack, 8, Q_ROLES)
    assert wide[a_path].shape == (2, 3, 5, 8) and wide[b_path].shape == (2, 3, 8, 6)
    np.testing.assert_array_equal(wide[a_path][..., :4], a)
    np.testing.assert_array_equal(wide[b_path][..., :4, :], b)
    assert not np.asarray(wide[a_path][..., 4:]).any() and not np.asarray(wide[b_path][..., 4:, :]).any()
    run = {a_path: jnp.full((2, 5, 3), 7.0), b_path: jnp.full((2, 3, 6), 9.0)}
    written = ts.write_slot_params(stack, jnp.int32(2), run, Q_ROLES)
    got_a, got_b = np.asarray(written[a_path]), np.asarray(written[b_path])
    assert (got_a[:, 2, :, :3] == 7).all() and not got_a[:, 2, :, 3:].any()
    assert (got_b[:, 2, :3] == 9).all() and not got_b[:, 2, 3:].any()
    np.testing.assert_array_equal(got_a[:, :2], a[:, :2])
    np.testing.assert_array_equal(got_b[:, :2], b[:, :2])


def test_a_slot_clear_zeroes_that_slot_alone_and_replaces_the_stacks_in_place() -> None:
    """The bank's slot clear is one program over every stacked adapter, and it donates them: the bank never
    holds two copies of its stacks (a leaked copy per clear is the whole bank's memory again)."""
    from tx.engine.train_step import clear_slot_params

    rng = np.random.RandomState(0)
    stacks = {("m", "lora_a"): jnp.asarray(rng.randn(2, 3, 5, 4), jnp.float32),
              ("m", "lora_b"): jnp.asarray(rng.randn(3, 4, 6), jnp.float32)}  # fmt: skip
    before = {p: np.array(v, copy=True) for p, v in stacks.items()}  # no view left on the donated buffers
    cleared = clear_slot_params(stacks, jnp.int32(1))
    assert all(v.is_deleted() for v in stacks.values())
    for path, want in before.items():
        want[..., 1, :, :] = 0.0
        np.testing.assert_array_equal(np.asarray(cleared[path]), want)


def test_a_slot_write_leaves_that_adapter_alone_in_the_slot() -> None:
    """Writing a run's adapter (here over one module of two) sets the slot whole: the module it does not train
    reads zero there, whatever the slot held before, and the other slots keep theirs."""
    roles = AdapterRoles(
        a=frozenset({("m", "lora_a"), ("n", "lora_a")}), b=frozenset({("m", "lora_b"), ("n", "lora_b")})
    )
    rng = np.random.RandomState(1)
    stacks = {("m", "lora_a"): rng.randn(3, 5, 4), ("m", "lora_b"): rng.randn(3, 4, 6),
              ("n", "lora_a"): rng.randn(3, 5, 4), ("n", "lora_b"): rng.randn(3, 4, 6)}  # fmt: skip
    stacks = {p: jnp.asarray(v, jnp.float32) for p, v in stacks.items()}
    before = {p: np.array(v, copy=True) for p, v in stacks.items()}
    params = {("m", "lora_a"): jnp.ones((5, 2)), ("m", "lora_b"): jnp.ones((2, 6))}  # rank 2 of the stack's 4
    out = {p: np.asarray(v) for p, v in ts.write_slot_params(stacks, jnp.int32(2), params, roles).items()}
    np.testing.assert_array_equal(out[("m", "lora_a")][2], np.pad(np.ones((5, 2)), ((0, 0), (0, 2))))
    np.testing.assert_array_equal(out[("m", "lora_b")][2], np.pad(np.ones((2, 6)), ((0, 2), (0, 0))))
    assert not out[("n", "lora_a")][2].any() and not out[("n", "lora_b")][2].any()
    for path, want in before.items():
        np.testing.assert_array_equal(out[path][:2], want[:2])
