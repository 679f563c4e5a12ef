"""Tinker loss functions over the flat tokens of a packed batch (pure JAX, no model code).

The engine flattens a packed batch to N tokens and gathers, per token, the learner log-probability of
each of K target tokens (`target_logprobs`, p below). `LossInputs` says which of D datums each token
belongs to and carries the datum's loss kind and config row, so one compiled program serves a batch
that mixes losses and configs: every formula is evaluated elementwise and the datum's kind selects
one. The batch loss is the plain sum of `token_losses` (Tinker sums, no normalisation; weights and
advantages carry any scaling). Invalid (padding) tokens and tokens of other kinds are fed benign
values before each formula, so a NaN or overflow there reaches neither the loss nor its gradient. Every
exp(log-ratio) goes on linearly past exp(`MAX_LOG_RATIO`), so a weighted token far off policy cannot overflow
either.

Per-token losses, with q = `sampling_logprobs`, A = `advantages`, w = `weights`, r = exp(p - q),
sg = stop-gradient, and RL losses multiplied by w[:, 0] (zero where w[:, 0] == 0):
  cross_entropy        -sum_k w[k] * p[k]        (K > 1: top-K soft targets; negative w allowed)
  importance_sampling  -r * A
  ppo                  -min(r * A, clip(r, clip_low, clip_high) * A)      bounds on the ratio itself
  cispo                -sg(clip(r, clip_low, clip_high)) * A * p
  dro                  -(p * A - beta / 2 * (p - q)^2)
  gspo (GSPO-token)    s = exp(mean over masked tokens of the datum of (sg(p) - q)); s_i = s * exp(p - sg(p));
                       -min(s_i * A, clip(s_i, clip_low, clip_high) * A)   (mask: sequence_ratio_mask != 0;
                       a datum with no masked token has s = 1)
  stable_reinforce     -sg(min(r, truncation)) * A * p + kl_coeff * (exp(q - p) - (q - p) - 1)

stable_reinforce is our own version of Tinker's unpublished loss: truncated-importance-weighted
REINFORCE where q is the behaviour log-probability of the sampled token (the datum's `logprobs`, as
returned by the server's sampler for that token), plus an optional k3 estimator of KL(p || q) that keeps
the learner near the behaviour policy. truncation defaults to 2.0, the cap commonly used for
truncated importance sampling (Yao et al., 2025): large enough to correct mild sampler/learner
mismatch, small enough to bound the variance of rare tokens. GSPO defaults 0.9997 / 1.0004 are the
GSPO paper's clip ranges (3e-4 below, 4e-4 above 1) written as bounds on the ratio, as Tinker's
clip thresholds are; the sequence ratio is a geometric mean, so it stays that close to 1.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

# The loss tables live in the JAX-free `tx.loss_spec`; re-exported for the engine's callers.
from tx.loss_spec import (  # noqa: F401
    CONFIG_COLUMNS,
    LOSS_CONFIG_DEFAULTS,
    LOSS_NAMES,
    config_row,
    loss_index,
    required_inputs,
    validate_loss,
)

_COLUMN = {key: index for index, key in enumerate(CONFIG_COLUMNS)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """Per-token and per-datum loss inputs of one packed batch (N tokens, D datums, C config columns)."""

    datum: jax.Array  # [N] int32 datum index of each token; padding: any index in [0, D)
    valid: jax.Array  # [N] bool; False for padding
    weights: jax.Array  # [N, K] float32; RL losses use column 0 (1 when the datum sent none)
    advantages: jax.Array  # [N] float32
    sampling_logprobs: jax.Array  # [N] float32 behaviour log-probabilities q
    ratio_mask: jax.Array  # [N] float32 gspo sequence_ratio_mask
    kind: jax.Array  # [D] int32 index into LOSS_NAMES
    config: jax.Array  # [D, C] float32 rows from config_row, columns CONFIG_COLUMNS
    trains: jax.Array  # [D] bool: the datum's loss is differentiated (False: a forward request's datum)


class _Tokens(NamedTuple):
    """One loss's view of the batch: tokens of other kinds and padding hold benign zeros."""

    p_NK: jax.Array
    q_N: jax.Array
    adv_N: jax.Array
    w_NK: jax.Array
    ratio_mask_N: jax.Array
    cfg_NC: jax.Array
    datum_N: jax.Array
    num_datums: int

    @property
    def p_N(self) -> jax.Array:
        return self.p_NK[:, 0]

    @property
    def w_N(self) -> jax.Array:
        return self.w_NK[:, 0]

    def column(self, key: str) -> jax.Array:
        return self.cfg_NC[:, _COLUMN[key]]

    def clip(self, ratio_N: jax.Array) -> jax.Array:
        return jnp.clip(ratio_N, self.column("clip_low_threshold"), self.column("clip_high_threshold"))


def _weighted(t: _Tokens, loss_N: jax.Array) -> jax.Array:
    return jnp.where(t.w_N != 0, t.w_N * loss_N, 0.0)


def _cross_entropy(t: _Tokens) -> jax.Array:
    # Unused top-K columns (w == 0) may hold -inf log-probabilities; keep them out of the product.
    p_NK = jnp.where(t.w_NK != 0, t.p_NK, 0.0)
    return -jnp.sum(t.w_NK * p_NK, axis=1)


# exp overflows float32 past 88.7. A weighted token whose learner log-probability stood that far above the
# sampler's made r = inf, and inf times a zero (the advantage of a group whose rewards all tie, or the zero
# cotangent of PPO's unchosen branch) turned the whole step's gradient NaN: the next optim_step refused it,
# and every other datum's gradient with it. Past `MAX_LOG_RATIO` the exponential goes on as its tangent
# line, so its value and gradient stay finite and keep their signs (a KL penalty still pulls p back), up to
# `MAX_LOG_RATIO_RUN` further, where it stops growing.
MAX_LOG_RATIO = 60.0
MAX_LOG_RATIO_RUN = 1e6


def _bounded_exp(log_ratio: jax.Array) -> jax.Array:
    past = jnp.clip(log_ratio - MAX_LOG_RATIO, 0.0, MAX_LOG_RATIO_RUN)
    return jnp.exp(jnp.minimum(log_ratio, MAX_LOG_RATIO)) * (1.0 + past)


def _ratio(t: _Tokens) -> jax.Array:
    """r = exp(p - q) (linear past `MAX_LOG_RATIO`), 1 on tokens of weight 0: a masked token's placeholder q (say
    -1e4) overflowed the exponential, and its zero cotangent times inf made the datum's gradient NaN."""
    return _bounded_exp(jnp.where(t.w_N != 0, t.p_N - t.q_N, 0.0))


def _importance_sampling(t: _Tokens) -> jax.Array:
    return _weighted(t, -_ratio(t) * t.adv_N)


def _ppo(t: _Tokens) -> jax.Array:
    ratio_N = _ratio(t)
    return _weighted(t, -jnp.minimum(ratio_N * t.adv_N, t.clip(ratio_N) * t.adv_N))


def _cispo(t: _Tokens) -> jax.Array:
    ratio_N = jax.lax.stop_gradient(_bounded_exp(t.p_N - t.q_N))
    return _weighted(t, -t.clip(ratio_N) * t.adv_N * t.p_N)


def _dro(t: _Tokens) -> jax.Array:
    return _weighted(t, -(t.p_N * t.adv_N - 0.5 * t.column("beta") * jnp.square(t.p_N - t.q_N)))


def _gspo(t: _Tokens) -> jax.Array:
    p_sg_N = jax.lax.stop_gradient(t.p_N)
    in_ratio_N = (t.ratio_mask_N != 0).astype(t.p_N.dtype)
    log_ratio_sum_D = jax.ops.segment_sum(in_ratio_N * (p_sg_N - t.q_N), t.datum_N, num_segments=t.num_datums)
    count_D = jax.ops.segment_sum(in_ratio_N, t.datum_N, num_segments=t.num_datums)
    seq_ratio_D = _bounded_exp(log_ratio_sum_D / jnp.maximum(count_D, 1.0))
    ratio_N = jnp.where(t.w_N != 0, seq_ratio_D[t.datum_N] * jnp.exp(t.p_N - p_sg_N), 1.0)  # as `_ratio`
    return _weighted(t, -jnp.minimum(ratio_N * t.adv_N, t.clip(ratio_N) * t.adv_N))


def _stable_reinforce(t: _Tokens) -> jax.Array:
    weight_N = jax.lax.stop_gradient(jnp.minimum(_bounded_exp(t.p_N - t.q_N), t.column("truncation")))
    kl_coeff_N = t.column("kl_coeff")
    # Without a KL term, exp(q - p) could overflow and turn a zero cotangent into NaN: feed p = q there.
    p_kl_N = jnp.where((kl_coeff_N != 0) & (t.w_N != 0), t.p_N, t.q_N)
    log_ratio_N = t.q_N - p_kl_N
    kl_N = _bounded_exp(log_ratio_N) - log_ratio_N - 1.0
    return _weighted(t, -weight_N * t.adv_N * t.p_N + kl_coeff_N * kl_N)


_FORMULAS = (_cross_entropy, _importance_sampling, _ppo, _cispo, _dro, _gspo, _stable_reinforce)


def _view(target_logprobs_NK: jax.Array, inputs: LossInputs, on_N: jax.Array) -> _Tokens:
    w_NK = jnp.where(on_N[:, None], inputs.weights, 0.0)
    return _Tokens(
        p_NK=jnp.where(on_N[:, None], target_logprobs_NK, 0.0),
        q_N=jnp.where(on_N, inputs.sampling_logprobs, 0.0),
        adv_N=jnp.where(on_N, inputs.advantages, 0.0),
        w_NK=w_NK,
        ratio_mask_N=jnp.where(on_N, inputs.ratio_mask, 0.0),
        cfg_NC=inputs.config[inputs.datum],
        datum_N=inputs.datum,
        num_datums=inputs.kind.shape[0],
    )


def token_losses(target_logprobs: jax.Array, inputs: LossInputs) -> jax.Array:
    """Per-token loss [N] (summed over K) of each datum's loss; zero for invalid tokens. Loss = its sum."""
    kind_N = inputs.kind[inputs.datum]
    loss_N = jnp.zeros(target_logprobs.shape[:1], target_logprobs.dtype)
    for index, formula in enumerate(_FORMULAS):
        on_N = inputs.valid & (kind_N == index)
        loss_N = loss_N + jnp.where(on_N, formula(_view(target_logprobs, inputs, on_N)), 0.0)
    return loss_N


def datum_sums(values: jax.Array, inputs: LossInputs) -> jax.Array:
    """Sum of per-token values [N] over each datum's valid tokens -> [D]."""
    masked_N = jnp.where(inputs.valid, values, 0)
    return jax.ops.segment_sum(masked_N, inputs.datum, num_segments=inputs.kind.shape[0])
