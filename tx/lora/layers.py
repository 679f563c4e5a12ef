"""Linear layers that carry stacked adapter slots next to their frozen base weight.

A layer built with `LoRASpec(slots, max_rank)` owns `lora_a [*stack, S, in, R]` and
`lora_b [*stack, S, R, out]` besides its `weight [*stack, out, in]`; `stack` is the leading layer axis
of scanned decoder blocks. Base kernels use the configured compute dtype; adapters are fp32 masters
cast to the compute dtype at use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.kernels import DEFAULT_KERNEL, Kernel, lora_delta
from tx.lora.params import LoRAA, LoRAB, LoRARows


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """Shape of the adapter stacks as built: how many slots (slot 0 = none), their rank width (the engine's
    adapter bank then resizes it to the ranks in use, `tx.engine.bank`), the kernel form."""

    slots: int
    max_rank: int
    kernel: Kernel = DEFAULT_KERNEL

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ValueError(f"LoRASpec.slots must be >= 2 (slot 0 is the base model), got {self.slots}")
        if self.max_rank < 1:
            raise ValueError(f"LoRASpec.max_rank must be >= 1, got {self.max_rank}")


def lora_pair(
    d_in: int, d_out: int, axes: tuple[str, str], spec: LoRASpec, stack: tuple[int, ...]
) -> tuple[LoRAA, LoRAB]:
    lead = ("layers",) * len(stack)
    a = LoRAA(
        jnp.zeros((*stack, spec.slots, d_in, spec.max_rank), jnp.float32),
        logical_axes=(*lead, "adapter", axes[0], "lora_rank"),
    )
    b = LoRAB(
        jnp.zeros((*stack, spec.slots, spec.max_rank, d_out), jnp.float32),
        logical_axes=(*lead, "adapter", "lora_rank", axes[1]),
    )
    return a, b


def linear(
    x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype | None = None, weight_major_rows: int = 0
) -> jax.Array:
    """x [..., I] @ weight.T for a weight in [out, in] layout.

    Decode batches of 2..`weight_major_rows` rows (one token each; 0 = never, the plain product) compute
    the product weight-major, `weight @ x.T` -> [O, B], and transpose the small result: XLA:CPU's matmul
    library streams the weight about twice as fast that way at 4-16 rows (`tx.tuning.CPU` has the
    numbers). The barrier keeps XLA from folding the transpose back into the product.
    """
    rows = x.shape[0]
    if x.ndim == 3 and x.shape[1] == 1 and 2 <= rows <= weight_major_rows:
        y = jnp.einsum("oi,bi->ob", weight, x[:, 0], preferred_element_type=out_dtype)
        return jax.lax.optimization_barrier(y).T[:, None, :]
    if out_dtype is None and x.ndim == 3 and x.shape[1] > 1:  # training and prefill
        return _product(x, weight)
    return jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=out_dtype)


@jax.custom_vjp
def _product(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [B, T, I] @ weight.T, whose weight gradient is taken as x^T g [I, O] and transposed after.

    Left to autodiff, XLA:CPU wrote the output gradient g transposed, [O, B*T], inside the elementwise
    fusion that makes it (SwiGLU's backward, for the gate and up projections): a strided write of the
    largest activation, about 480 ms of a 1.86 s `small` full fine-tuning step on an Intel Xeon (AMX).
    Transposing the [I, O] product instead (kept apart by the barrier) took the step from 1.81-1.92 s to
    1.50-1.59 s (fp32, alternating runs); a LoRA step, which takes no weight gradient, is unchanged."""
    return jnp.einsum("...i,oi->...o", x, weight)


def _product_fwd(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _product(x, weight), (x, weight)


def _product_bwd(saved: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, weight = saved
    dw_IO = jax.lax.optimization_barrier(jnp.einsum("...i,...o->io", x, g))
    return jnp.einsum("...o,oi->...i", g, weight), dw_IO.T


_product.defvjp(_product_fwd, _product_bwd)


class LoRALinear(nnx.Module):
    """y = x @ weight.T (+ the row's adapter delta), `weight` in the HF checkpoint's [out, in] layout.

    The [out, in] layout is also the faster one for batch-1 decode here (4.7 vs 5.3 ms per step on
    `small` with jax 0.10); [in, out] saves YNNPACK's per-call weight re-packing at batch 8 (~5% per
    decode chunk) but measured the same through the SDK, and training runs at the same speed in either.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        axes: tuple[str, str],
        dtype: jnp.dtype,
        lora: LoRASpec | None = None,
        stack: tuple[int, ...] = (),
        weight_major_rows: int = 0,
        bias: bool = False,
    ) -> None:
        """`weight_major_rows`: see `linear` (a backend choice, `tx.tuning.Tuning`); `bias`: a frozen
        `bias [*stack, out]` added to the base product (gpt-oss's attention)."""
        lead = ("layers",) * len(stack)
        self.weight = nnx.Param(jnp.zeros((*stack, d_out, d_in), dtype), logical_axes=(*lead, axes[1], axes[0]))
        if bias:
            self.bias = nnx.Param(jnp.zeros((*stack, d_out), dtype), logical_axes=(*lead, axes[1]))
        self.kernel_form: Kernel = lora.kernel if lora else DEFAULT_KERNEL
        self.weight_major_rows = weight_major_rows
        if lora is not None:
            self.lora_a, self.lora_b = lora_pair(d_in, d_out, axes, lora, stack)

    def __call__(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        y = linear(x, self.weight[...], weight_major_rows=self.weight_major_rows)
        if hasattr(self, "bias"):
            y = y + self.bias[...]
        if rows is not None and hasattr(self, "lora_a"):
            y = y + lora_delta(x, rows, self.lora_a[...], self.lora_b[...], self.kernel_form)
        return y
