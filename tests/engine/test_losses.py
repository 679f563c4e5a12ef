"""Loss parity: every Tinker loss against an independent float64 torch reference written from the protocol.

One packed batch mixes every loss kind (and per-datum configs), so the per-datum selection is what is
tested; all cases share one shape so the jitted function compiles once.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tx.engine import losses
from tx.engine.losses import LossInputs

N, K = 96, 3
# (loss, loss_fn_config, number of tokens); the spare tokens are padding.
DATUMS: list[tuple[str, dict[str, float] | None, int]] = [
    ("cross_entropy", None, 6),  # soft targets over K columns
    ("cross_entropy", None, 7),  # custom-loss path: arbitrary signed weights
    ("importance_sampling", None, 6),
    ("ppo", None, 8),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, 6),
    ("cispo", None, 6),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, 5),
    ("dro", {"beta": 0.3}, 6),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, 7),  # sequence ratio inside the bounds
    ("gspo", None, 5),  # default bounds: the sequence ratio is clipped
    ("stable_reinforce", {"truncation": 1.1, "kl_coeff": 0.1}, 6),
    ("dro", None, 4),
    ("stable_reinforce", None, 5),
]
# The defaults as the protocol (shared/tinker-protocol.md §7.7) and tx.engine.losses' docstring state them,
# written out here so a wrong default in the implementation's table cannot also fill the reference's.
DEFAULTS: dict[str, dict[str, float]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004},
    "stable_reinforce": {"truncation": 2.0, "kl_coeff": 0.0},
}
D = len(DATUMS)


@dataclasses.dataclass
class Case:
    """A host-side batch: numpy arrays for JAX, per-datum token positions for the reference."""

    target_logprobs: np.ndarray  # [N, K] float32
    inputs: LossInputs
    positions: list[np.ndarray]  # per datum, the token indices in the flat batch


def make_case(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    order = rng.permutation(D)
    # Pack datums in a random order, with padding runs between some of them.
    datum = np.zeros(N, np.int32)
    valid = np.zeros(N, bool)
    positions: list[np.ndarray] = [np.zeros(0, np.int64)] * D
    cursor = 0
    for d in order:
        cursor += int(rng.integers(0, 2))
        n = DATUMS[d][2]
        positions[d] = np.arange(cursor, cursor + n)
        datum[cursor : cursor + n], valid[cursor : cursor + n] = d, True
        cursor += n
    assert cursor <= N
    datum[~valid] = rng.integers(0, D, size=int((~valid).sum()))

    p = -rng.exponential(1.0, size=(N, K)).astype(np.float32)
    q = (p[:, 0] + rng.normal(0.0, 0.3, size=N)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, size=N).astype(np.float32)
    weights = np.zeros((N, K), np.float32)
    weights[:, 0] = np.where(rng.random(N) < 0.2, 0.0, 1.0)  # some prompt tokens of RL datums
    ratio_mask = (rng.random(N) < 0.8).astype(np.float32)
    ratio_mask[[pos[0] for pos in positions]] = 1.0  # every datum has a token in its sequence ratio
    ratio_mask[positions[9][1:]] = 0.0  # and one gspo datum's ratio is over that single token
    ce_soft, ce_custom = positions[0], positions[1]
    weights[ce_soft] = rng.dirichlet(np.ones(K), size=len(ce_soft))
    weights[ce_soft[0], 2] = 0.0
    weights[ce_custom, 0] = rng.normal(0.0, 2.0, size=len(ce_custom))
    weights[positions[2], 0] *= 0.5
    sr = positions[-1][:3]  # default stable_reinforce: ratios above the default truncation and between 1.5 and 2
    q[sr] = p[sr, 0] - np.array([1.0, 0.6, -0.2], np.float32)
    weights[sr, 0] = 1.0
    # Unused top-K columns and padding may hold anything; none of it may leak.
    p[:, 1:][weights[:, 1:] == 0] = -np.inf
    p[~valid] = np.nan
    adv[~valid], q[~valid], weights[~valid] = np.nan, np.inf, np.nan

    inputs = LossInputs(
        datum=datum,
        valid=valid,
        weights=weights,
        advantages=adv,
        sampling_logprobs=q,
        ratio_mask=ratio_mask,
        kind=np.array([losses.loss_index(name) for name, _, _ in DATUMS], np.int32),
        config=np.array([losses.config_row(name, cfg) for name, cfg, _ in DATUMS], np.float32),
        trains=np.ones(len(DATUMS), bool),
    )
    return Case(p, inputs, positions)


@jax.jit
def losses_and_grads(target_logprobs: jax.Array, inputs: LossInputs) -> tuple[jax.Array, jax.Array]:
    loss_N = losses.token_losses(target_logprobs, inputs)
    grad_NK = jax.grad(lambda p: losses.token_losses(p, inputs).sum())(target_logprobs)
    return loss_N, grad_NK


def reference_loss(name: str, cfg: dict[str, float], p: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token loss of one datum per tinker-protocol §7.7, written independently of tx."""
    if name == "cross_entropy":
        w = t["weights"]
        return -(w * torch.where(w != 0, p, torch.zeros_like(p))).sum(dim=1)
    lp, q, a, w = p[:, 0], t["q"], t["adv"], t["weights"][:, 0]
    ratio = torch.exp(lp - q)
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if name == "importance_sampling":
        loss = -ratio * a
    elif name == "ppo":
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)
    elif name == "cispo":
        loss = -torch.clamp(ratio, lo, hi).detach() * lp * a
    elif name == "dro":
        loss = -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2)
    elif name == "gspo":
        m = t["mask"] != 0
        seq = torch.exp((lp.detach()[m] - q[m]).mean())
        s = seq * torch.exp(lp - lp.detach())
        loss = -torch.minimum(s * a, torch.clamp(s, lo, hi) * a)
    elif name == "stable_reinforce":
        kl = torch.exp(q - lp) - (q - lp) - 1
        loss = -torch.clamp(ratio, max=cfg["truncation"]).detach() * a * lp + cfg["kl_coeff"] * kl
    return w * loss


def reference(case: Case) -> tuple[np.ndarray, np.ndarray]:
    p_all = torch.tensor(case.target_logprobs, dtype=torch.float64, requires_grad=True)
    loss_N = torch.zeros(N, dtype=torch.float64)
    inp = case.inputs
    for d, (name, cfg, _) in enumerate(DATUMS):
        idx = torch.tensor(case.positions[d])
        t = {
            "weights": torch.tensor(inp.weights, dtype=torch.float64)[idx],
            "q": torch.tensor(inp.sampling_logprobs, dtype=torch.float64)[idx],
            "adv": torch.tensor(inp.advantages, dtype=torch.float64)[idx],
            "mask": torch.tensor(inp.ratio_mask)[idx],
        }
        full_cfg = {**DEFAULTS.get(name, {}), **(cfg or {})}
        loss_N = loss_N.index_put((idx,), reference_loss(name, full_cfg, p_all[idx], t))
    loss_N.sum().backward()
    assert p_all.grad is not None
    return loss_N.detach().numpy(), p_all.grad.numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_torch(seed: int) -> None:
    case = make_case(seed)
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(case.target_logprobs, case.inputs))
    want_loss_N, want_grad_NK = reference(case)
    np.testing.assert_allclose(loss_N, want_loss_N, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_NK, want_grad_NK, rtol=1e-5, atol=1e-6)
    # The cases exercise the interesting branches: nonzero gradients everywhere they should be.
    for d in range(D):
        assert np.abs(grad_NK[case.positions[d]]).sum() > 0, DATUMS[d]


def test_invalid_tokens_contribute_nothing() -> None:
    case = make_case(3)
    valid = case.inputs.valid
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(case.target_logprobs, case.inputs))
    assert np.isfinite(loss_N).all() and np.isfinite(grad_NK).all()
    assert (loss_N[~valid] == 0).all() and (grad_NK[~valid] == 0).all()
    # Invalidating a whole datum removes exactly its tokens' losses.
    drop = case.positions[3]
    fewer = dataclasses.replace(case.inputs, valid=np.where(np.isin(np.arange(N), drop), False, valid))
    loss2_N, _ = losses_and_grads(case.target_logprobs, fewer)
    np.testing.assert_array_equal(np.asarray(loss2_N), np.where(np.isin(np.arange(N), drop), 0.0, loss_N))


def test_far_off_policy_tokens_stay_finite() -> None:
    """exp(q - p) overflows for p = -200; with kl_coeff = 0 that must not become NaN (0 * inf)."""
    case = make_case(6)
    sr = case.positions[10]
    case.target_logprobs[sr, 0] = -200.0
    case.inputs.sampling_logprobs[sr] = -1.0
    case.inputs.config[10] = losses.config_row("stable_reinforce", {"kl_coeff": 0.0})
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(case.target_logprobs, case.inputs))
    assert np.isfinite(loss_N).all() and np.isfinite(grad_NK).all()
    adv, w = case.inputs.advantages[sr], case.inputs.weights[sr, 0]
    np.testing.assert_allclose(grad_NK[sr, 0], -math.exp(-199.0) * adv * w, atol=1e-30)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "gspo", "cispo", "dro", "stable_reinforce"])
def test_a_masked_tokens_placeholder_logprob_leaves_the_gradient_finite(name: str) -> None:
    """A token of weight 0 whose `logprobs` is a placeholder far below the learner's (-1e4): exp(p - q)
    overflowed, and its zero cotangent times inf made the datum's gradient NaN. Its loss and gradient are 0;
    the weighted token's are what they are alone."""
    inputs = LossInputs(
        datum=jnp.zeros(2, jnp.int32),
        valid=jnp.ones(2, bool),
        weights=jnp.array([[0.0], [1.0]]),
        advantages=jnp.array([1.0, 1.0]),
        sampling_logprobs=jnp.array([-1e4, -1.0]),
        ratio_mask=jnp.array([0.0, 1.0]),
        kind=jnp.array([losses.loss_index(name)], jnp.int32),
        config=jnp.array([losses.config_row(name, {})], jnp.float32),
        trains=jnp.ones(1, bool),
    )
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(jnp.array([[-1.0], [-1.0]]), inputs))
    assert np.isfinite(loss_N).all() and np.isfinite(grad_NK).all(), (loss_N, grad_NK)
    assert loss_N[0] == 0 and grad_NK[0, 0] == 0 and grad_NK[1, 0] != 0


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "gspo", "cispo", "stable_reinforce"])
@pytest.mark.parametrize("advantage", [1.0, 0.0, -1.0])
def test_a_weighted_token_far_above_its_sampling_logprob_keeps_the_step_finite(name: str, advantage: float) -> None:
    """p - q = 99 overflowed exp(p - q): PPO's clipped token took NaN through its unchosen branch, and a zero
    advantage (a group whose rewards tie) made inf * 0. The step's gradient must stay finite, the other
    token's gradient must be what it is alone, and with no advantage the far token adds nothing."""

    def inputs(q_far: float) -> LossInputs:
        return LossInputs(
            datum=jnp.zeros(2, jnp.int32),
            valid=jnp.ones(2, bool),
            weights=jnp.ones((2, 1)),
            advantages=jnp.array([advantage, 1.0]),
            sampling_logprobs=jnp.array([q_far, -1.0]),
            ratio_mask=jnp.array([0.0, 1.0]),
            kind=jnp.array([losses.loss_index(name)], jnp.int32),
            config=jnp.array([losses.config_row(name, {"kl_coeff": 0.1} if name == "stable_reinforce" else {})]),
            trains=jnp.ones(1, bool),
        )

    p_NK = jnp.array([[-1.0], [-1.2]])
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(p_NK, inputs(-100.0)))
    assert np.isfinite(loss_N).all() and np.isfinite(grad_NK).all(), (loss_N, grad_NK)
    if advantage == 0.0 and name != "stable_reinforce":  # its KL term does not vanish with the advantage
        assert loss_N[0] == 0 and grad_NK[0, 0] == 0
    if name != "gspo":  # gspo's sequence ratio couples the tokens
        _, alone_NK = (np.asarray(x) for x in losses_and_grads(p_NK, inputs(-1.0)))
        np.testing.assert_allclose(grad_NK[1], alone_NK[1], rtol=1e-6)


@pytest.mark.parametrize("gap", [30.0, 61.0, 65.0, 200.0])
def test_the_kl_penalty_pulls_a_far_learner_back_however_far(gap: float) -> None:
    """stable_reinforce's k3 term exp(q - p) - (q - p) - 1 with q - p = gap: its gradient in p is
    1 - exp(gap), always negative (raising p lowers the penalty). A capped exponential left only the linear
    term's +1 past the cap, pushing p further away."""
    inputs = LossInputs(
        datum=jnp.zeros(1, jnp.int32),
        valid=jnp.ones(1, bool),
        weights=jnp.ones((1, 1)),
        advantages=jnp.zeros(1),
        sampling_logprobs=jnp.array([-1.0]),
        ratio_mask=jnp.zeros(1),
        kind=jnp.array([losses.loss_index("stable_reinforce")], jnp.int32),
        config=jnp.array([losses.config_row("stable_reinforce", {"kl_coeff": 1.0})]),
        trains=jnp.ones(1, bool),
    )
    loss_N, grad_NK = (np.asarray(x) for x in losses_and_grads(jnp.array([[-1.0 - gap]]), inputs))
    assert np.isfinite(loss_N).all() and np.isfinite(grad_NK).all()
    assert grad_NK[0, 0] < -1e12 if gap > 30 else grad_NK[0, 0] == pytest.approx(1 - math.exp(gap), rel=1e-4)


def test_cross_entropy_gradient_is_minus_weights() -> None:
    """forward_backward_custom relies on this: weights = -g must give gradient g, whatever its sign."""
    case = make_case(4)
    _, grad_NK = losses_and_grads(case.target_logprobs, case.inputs)
    for d in (0, 1):
        idx = case.positions[d]
        np.testing.assert_allclose(np.asarray(grad_NK)[idx], -case.inputs.weights[idx], rtol=1e-6)


def test_datum_sums() -> None:
    case = make_case(5)
    loss_N, _ = losses_and_grads(case.target_logprobs, case.inputs)
    sums_D = np.asarray(losses.datum_sums(jnp.asarray(loss_N), case.inputs))
    want_D = [np.asarray(loss_N)[case.positions[d]].sum() for d in range(D)]
    np.testing.assert_allclose(sums_D, want_D, rtol=1e-6, atol=1e-6)


def test_validate_loss_fills_defaults() -> None:
    assert losses.validate_loss("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert losses.validate_loss("cispo", {"clip_high_threshold": 5}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 5.0,
    }
    assert losses.validate_loss("dro", {}) == {"beta": 0.05}
    assert losses.validate_loss("cross_entropy", None) == {}
    assert set(losses.LOSS_CONFIG_DEFAULTS) == set(losses.LOSS_NAMES)
    for name, defaults in losses.LOSS_CONFIG_DEFAULTS.items():
        assert set(defaults) <= set(losses.CONFIG_COLUMNS), name


def test_validate_loss_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"'custom'.*cross_entropy.*stable_reinforce"):
        losses.validate_loss("custom", None)
    with pytest.raises(ValueError, match=r"'clip_ratio'.*clip_low_threshold, clip_high_threshold"):
        losses.validate_loss("ppo", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match=r"'beta'.*allowed keys: none"):
        losses.validate_loss("cross_entropy", {"beta": 0.1})
    with pytest.raises(ValueError, match="'beta'"):
        losses.validate_loss("dro", {"beta": "high"})
    with pytest.raises(ValueError, match="'kl_coeff'"):
        losses.validate_loss("stable_reinforce", {"kl_coeff": math.nan})
    with pytest.raises(ValueError, match=r"'beta' must be a finite number within ±3.4e\+38, got 1e\+300"):
        losses.validate_loss("dro", {"beta": 1e300})  # finite in float64, infinite in the engine's float32
    assert losses.validate_loss("dro", {"beta": 3e38}) == {"beta": 3e38}
    # Values that turn a loss against its purpose (an unbounded reward for leaving the sampling policy, every
    # importance weight's sign flipped) are refused, naming the key and its bound; the bounds themselves pass.
    refused = [
        ("dro", "beta", -0.1, ">="),
        ("stable_reinforce", "kl_coeff", -1.0, ">="),
        ("stable_reinforce", "truncation", 0.0, ">"),
        ("ppo", "clip_low_threshold", -0.5, ">="),
    ]
    for name, key, bad, relation in refused:
        with pytest.raises(ValueError, match=rf"'{key}' must be {relation} 0, got {bad:g}"):
            losses.validate_loss(name, {key: bad})
    assert losses.validate_loss("stable_reinforce", {"kl_coeff": 0, "truncation": 1e-3})["truncation"] == 1e-3
    assert losses.validate_loss("dro", {"beta": 0})["beta"] == 0
    with pytest.raises(ValueError, match="clip_low_threshold"):
        losses.validate_loss("gspo", {"clip_low_threshold": 1.5})


def test_config_row_and_required_inputs() -> None:
    columns = losses.CONFIG_COLUMNS
    row = losses.config_row("stable_reinforce", {"kl_coeff": 0.5})
    assert dict(zip(columns, row, strict=True)) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 0.0,
        "beta": 0.0,
        "truncation": 2.0,
        "kl_coeff": 0.5,
    }
    assert losses.required_inputs("cross_entropy") == ("target_tokens",)
    assert losses.required_inputs("ppo") == ("target_tokens", "logprobs", "advantages")
    assert "sequence_ratio_mask" in losses.required_inputs("gspo")
    assert "logprobs" in losses.required_inputs("stable_reinforce")
    with pytest.raises(ValueError, match="unsupported loss_fn"):
        losses.required_inputs("dppo")
