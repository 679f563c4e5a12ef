"""The jitted training programs: forward, gradient (LoRA or full), accumulate, AdamW step.

Each program takes named pytrees (`TrainBatch`, the model's states) and is built once per graph; shapes
come from the host-side bucketing in `batching.py`, so a workload replays without new compiles. The
model is split once into LoRA weights (`LoRAParam`) and base weights; a LoRA run differentiates the
former, a full fine-tuning run the latter, through the same loss code. Which flat paths are LoRA A and B
factors comes from their variable types (`AdapterRoles`), passed to every program that cuts or pads them.
Dimension letters: R rows, T row length, N = R*T tokens, K targets per token, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tx.engine.compiles import train_jit
from tx.engine.losses import LossInputs, token_losses
from tx.engine.vocab_blocks import block_size, over_blocks
from tx.lora.params import AdapterRoles
from tx.lora.select import Selection, slot_put, slot_slice, take_adapters
from tx.protocol import AdamParams

Flat = dict[tuple[str, ...], jax.Array]
_jit = train_jit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    tokens: jax.Array  # [R, T] int32
    positions: jax.Array  # [R, T] int32, restarting per packed segment
    segments: jax.Array  # [R, T] int32, 0 = padding
    targets: jax.Array  # [R, T, K] int32
    adapters: Selection | None  # the slots the rows read (None: no row has an adapter)
    loss: LossInputs  # over the N = R*T flattened tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    target_logprobs: jax.Array  # [N, K]
    token_loss: jax.Array  # [N]
    expert_picks: jax.Array | None = None  # [L, N, k] int16: the experts each token picked (MoE models)


# A micro-batch's logits are built whole up to this many (256 MiB of float32); above it, a block of
# positions at a time, recomputed in the backward (`head_logprobs`).
LOGIT_ELEMENTS = 1 << 26


def _outputs(model: Any, batch: TrainBatch, logit_elements: int) -> tuple[jax.Array, StepOutputs]:
    rows = None if batch.adapters is None else batch.adapters.rows
    h, _, picks = model.hidden_and_picks(batch.tokens, batch.positions, batch.segments, rows)
    target_lp = head_logprobs(model, h, rows, batch.targets, logit_elements)  # [R, T, K]
    R, T, K = batch.targets.shape
    target_lp = target_lp.reshape(R * T, K)
    # A forward request's datums (fused with training ones) report their losses and add no gradient: no
    # cotangent reaches their log-probabilities, not even 0 times an overflowed loss derivative.
    trains_N = batch.loss.trains[batch.loss.datum]
    loss_N = token_losses(jnp.where(trains_N[:, None], target_lp, jax.lax.stop_gradient(target_lp)), batch.loss)
    return loss_N.sum(), StepOutputs(target_lp, loss_N, picks)


def head_logprobs(model: Any, h_RTD: jax.Array, rows: Any, targets_RTK: jax.Array, elements: int) -> jax.Array:
    """The targets' log-probabilities under the model's head, [R, T, K]. Logits that fit `elements` are
    built at once; larger ones a block of positions at a time, each block's logits recomputed in the
    backward rather than kept (one more head product, only there): at Qwen3.5's 248k vocabulary a 16384-
    token micro-batch otherwise held 16 GB of logits and made as much again for their gradient."""
    R, T, _ = h_RTD.shape
    vocab = model.config.vocab_size

    def head(h_RCD: jax.Array, t_RCK: jax.Array) -> jax.Array:
        return target_logprobs(model.logits(h_RCD, rows), t_RCK)

    if R * T * vocab <= elements:
        return head(h_RTD, targets_RTK)
    return over_blocks(jax.checkpoint(head), block_size(R, T, vocab, elements), h_RTD, targets_RTK)


@jax.custom_vjp
def target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(logits)[..., targets]: logits [..., V] float32, targets [..., K] -> [..., K].

    Differentiated by hand: the gradient is `g_k` at each target minus `sum(g) * softmax`, written in one
    pass over the logits plus a scatter of the N*K target terms. Autodiff of log_softmax + gather kept a
    second [N, V] array and zero-filled a third for the gather's transpose (`small` step: 0.95 -> 0.88 s).
    """
    return _target_logprobs_fwd(logits, targets)[0]


def _target_logprobs_fwd(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple]:
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.take_along_axis(logits, targets, axis=-1) - lse, (logits, lse, targets)


def _target_logprobs_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, None]:
    logits, lse, targets = res
    d = jnp.exp(logits - lse) * -g.sum(-1, keepdims=True)
    lead = jnp.indices(targets.shape, sparse=True)[:-1]
    return d.at[(*lead, targets)].add(g), None


target_logprobs.defvjp(_target_logprobs_fwd, _target_logprobs_bwd)


def flat(state: nnx.State) -> Flat:
    """An nnx State as {path: array}: the engine's canonical, jit-friendly form of a weight set."""
    return {tuple(str(k) for k in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def as_state(weights: Flat) -> nnx.State:
    return nnx.from_flat_state(list(weights.items()))


class StepFunctions:
    """The compiled programs for one model graph; `lora` is the trainable split when True.

    Every program first cuts the stacked adapters to the batch's selection (`tx.lora.select`), so a
    LoRA gradient comes back over the compact stack: [..., G, in, R'] / [..., G, R', out], indexed
    like `batch.adapters.active`.
    """

    def __init__(self, graphdef: nnx.GraphDef, roles: AdapterRoles, logit_elements: int = LOGIT_ELEMENTS) -> None:
        self.graphdef = graphdef
        self.roles = roles
        self.logit_elements = logit_elements
        self.forward = _jit(self._forward, checked=True)
        self.lora_grad = _jit(functools.partial(self._grad, train_lora=True), checked=True)
        self.full_grad = _jit(functools.partial(self._grad, train_lora=False), checked=True)

    def model(self, lora: Flat, base: Flat) -> Any:
        return nnx.merge(self.graphdef, as_state(lora), as_state(base))

    def _forward(self, lora: Flat, base: Flat, batch: TrainBatch) -> StepOutputs:
        return _outputs(self.model(self._compact(lora, batch), base), batch, self.logit_elements)[1]

    def _grad(self, lora: Flat, base: Flat, batch: TrainBatch, *, train_lora: bool) -> tuple[Flat, StepOutputs]:
        lora = self._compact(lora, batch)

        def loss_fn(trainable: Flat, frozen: Flat) -> tuple[jax.Array, StepOutputs]:
            pair = (trainable, frozen) if train_lora else (frozen, trainable)
            return _outputs(self.model(*pair), batch, self.logit_elements)

        grads, out = jax.grad(loss_fn, has_aux=True)(*((lora, base) if train_lora else (base, lora)))
        return grads, out

    def _compact(self, lora: Flat, batch: TrainBatch) -> Flat:
        return lora if batch.adapters is None else take_adapters(lora, batch.adapters, self.roles)


# ---- per-run slices of the stacked adapter slots -------------------------------------------------


@functools.partial(_jit, static_argnames=("roles",), donate_argnums=0)
def accumulate_slot(acc: Flat, grads: Flat, slot: jax.Array, roles: AdapterRoles) -> Flat:
    """acc[path] += slice `slot` of grads[path], at the accumulator's rank (LoRA runs: the run's index in the
    compact stack the gradient was taken over)."""
    return {p: acc[p] + slot_slice(grads[p], slot, roles.rank_of(p, acc[p]), roles.is_a(p)) for p in acc}


@functools.partial(_jit, donate_argnums=0)
def accumulate_full(acc: Flat, grads: Flat) -> Flat:
    return {p: acc[p] + grads[p].astype(acc[p].dtype) for p in acc}


@functools.partial(_jit, static_argnames=("roles",))
def read_slot_params(lora: Flat, slot: jax.Array, like: Flat, roles: AdapterRoles) -> Flat:
    """Slot `slot` of every stacked adapter in `like`, cut to the rank `like` has there."""
    return {p: slot_slice(lora[p], slot, roles.rank_of(p, like[p]), roles.is_a(p)) for p in like}


@functools.partial(_jit, static_argnames=("roles",), donate_argnums=0)
def write_slot_params(lora: Flat, slot: jax.Array, params: Flat, roles: AdapterRoles) -> Flat:
    """`params` (one run's adapter) into slot `slot` of the stacks, zero-padded to their rank; the slot then
    holds that adapter alone (the modules it does not train are zero there)."""
    return {p: slot_put(v, slot, params[p] if p in params else _slot_zeros(v), roles.is_a(p)) for p, v in lora.items()}


@_jit
def all_finite(tree: Flat) -> jax.Array:
    """bool []: no inf or NaN in any array of `tree`."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


@functools.partial(jax.jit, static_argnames=("rank", "a_paths"))
def new_run_params(stacks: Flat, slot: jax.Array, rank: int, a_paths: frozenset) -> Flat:
    """A new run's parameters: its slot of every stacked adapter, first `rank` columns, in one program (one
    eager take per weight compiled a program each: ~0.25 s of a `small` run's creation)."""
    return {p: slot_slice(v, slot, rank, p in a_paths) for p, v in stacks.items()}


def zeros_of(shapes: dict[tuple[str, ...], jax.ShapeDtypeStruct]) -> Flat:
    """Zeros of every shape, made by one program (not one per shape)."""
    return _zeros(tuple((p, v.shape, np.dtype(v.dtype).name) for p, v in shapes.items()))


@functools.partial(jax.jit, static_argnames=("spec",))
def _zeros(spec: tuple[tuple[tuple[str, ...], tuple[int, ...], str], ...]) -> Flat:
    return {p: jnp.zeros(shape, dtype) for p, shape, dtype in spec}


def _slot_zeros(stacked: jax.Array) -> jax.Array:
    return jnp.zeros(stacked.shape[:-3] + stacked.shape[-2:], stacked.dtype)


@functools.partial(_jit, static_argnames=("rank", "roles"))
def slot_at_rank(lora: Flat, slot: jax.Array, rank: int, roles: AdapterRoles) -> Flat:
    """Slot `slot` of every stacked adapter cut to `rank` (one program: a sampler snapshot moving to host)."""
    return {p: slot_slice(v, slot, rank, roles.is_a(p)) for p, v in lora.items()}


@functools.partial(_jit, donate_argnums=0)
def clear_slot_params(lora: Flat, slot: jax.Array) -> Flat:
    """Slot `slot` of every stacked adapter set to zero (one program for the whole bank)."""
    return {p: slot_put(v, slot, _slot_zeros(v), True) for p, v in lora.items()}


@functools.partial(_jit, static_argnames=("width", "roles"))
def resize_stacks(lora: Flat, width: int, roles: AdapterRoles) -> Flat:
    """Every stacked adapter cut or zero-padded to `width` rank columns (the bank's rank bucket)."""
    return {p: _to_width(v, width, roles.is_a(p)) for p, v in lora.items()}


def _to_width(x: jax.Array, width: int, a: bool) -> jax.Array:
    axis = x.ndim - 1 if a else x.ndim - 2
    if width <= x.shape[axis]:
        return jax.lax.slice_in_dim(x, 0, width, axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, width - x.shape[axis])
    return jnp.pad(x, widths)


# ---- AdamW ------------------------------------------------------------------------------------------


def make_optimizer() -> optax.GradientTransformation:
    """AdamW (torch semantics: decoupled decay p -= lr*wd*p) with per-step hyper-parameters as inputs (every
    step sets them; the state starts from the API's defaults, which no step reads)."""
    d = AdamParams()
    return optax.inject_hyperparams(optax.adamw)(d.learning_rate, d.beta1, d.beta2, d.eps, weight_decay=d.weight_decay)


ROUNDING_SEED = 0x5EED  # the stochastic rounding's noise: a function of (step, weight), the same on every process


def _rounded(value: jax.Array, dtype: jnp.dtype, step_key: jax.Array, index: int) -> jax.Array:
    """A float32 weight after its update, stored in `dtype`. bfloat16 rounds stochastically: up with the
    probability of the distance to the value below, so the stored weight equals the float32 one on average.
    Rounded to nearest, an update under half a bfloat16 step was lost whole: at a weight of 0.05 a step is
    2.4e-4, and a full fine-tuning update at lr 1e-5 (about 1e-5 a weight) never changed anything."""
    if dtype != jnp.bfloat16:
        return value.astype(dtype)
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32)
    noise = jax.random.bits(jax.random.fold_in(step_key, index), value.shape, jnp.uint32) >> 16
    kept = (bits + noise) & jnp.uint32(0xFFFF0000)  # the magnitude's low 16 bits carried up, then dropped
    rounded = jax.lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)
    # A NaN's payload could carry into the sign bit and read as -0.0, passing the step's finite check.
    return jnp.where(jnp.isfinite(value), rounded, value.astype(jnp.bfloat16))


@_jit
def copy_weights(weights: Flat) -> Flat:
    """A compiled copy of a weight set, placed like step outputs: a full fine-tuning run's own base weights, a
    LoRA run's gradient accumulators saved before a batch (one program, where an eager copy per leaf took one
    dispatch each)."""
    return {p: jnp.copy(v) for p, v in weights.items()}


@functools.partial(_jit, static_argnames="grad_dtype")
def fresh_state(params: Flat, grad_dtype: Any = None) -> tuple[Flat, Any]:
    """Zero gradient accumulators (in `grad_dtype`, default the params') and a new AdamW state for `params`,
    float32 whatever the params' dtype (as `adam_step` returns it: bfloat16 moments were rounded on the
    first update and recompiled `adam_step` on the second)."""
    grads = {p: jnp.zeros(v.shape, grad_dtype or v.dtype) for p, v in params.items()}
    return grads, make_optimizer().init({p: v.astype(jnp.float32) for p, v in params.items()})


@functools.partial(_jit, donate_argnums=(0, 1, 2))
def adam_step(
    params: Flat, opt_state: Any, grads: Flat, hp: dict[str, jax.Array]
) -> tuple[Flat, Any, Flat, jax.Array, jax.Array]:
    """One AdamW step; returns new params, optimizer state, zeroed grads, the pre-clip grad norm and whether
    the step was applied. A gradient that is not finite (inf or NaN anywhere), or an update that is not (a
    finite gradient under hyper-parameters that overflow float32), leaves the params and optimizer state as
    they were: one such update would turn every weight of the run into NaN for good, and NaN adapter
    weights poison the products of every adapter batched beside them (0 * NaN is NaN)."""
    norm = optax.global_norm(grads)
    clip = hp["grad_clip_norm"]
    factor = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    grads32 = jax.tree.map(lambda g: (g * factor).astype(jnp.float32), grads)
    for name in ("learning_rate", "b1", "b2", "eps", "weight_decay"):
        opt_state.hyperparams[name] = hp[name]
    updates, new_state = make_optimizer().update(grads32, opt_state, params)
    step_key = jax.random.fold_in(jax.random.key(ROUNDING_SEED), opt_state.count)
    new_params = {
        path: _rounded(params[path].astype(jnp.float32) + updates[path], params[path].dtype, step_key, index)
        for index, path in enumerate(sorted(params))
    }
    finite = [jnp.isfinite(p).all() for p in jax.tree.leaves(new_params)]
    applied = jnp.isfinite(norm) & jnp.all(jnp.stack(finite))
    keep = functools.partial(jnp.where, applied)
    params, opt_state = jax.tree.map(keep, (new_params, new_state), (params, opt_state))
    return params, opt_state, jax.tree.map(jnp.zeros_like, grads), norm, applied
