"""Training runs on one loaded model: LoRA runs in adapter slots, full fine-tuning runs on own copies.

The trainer owns the model's weights as two flat dicts (`base`, `lora`: {path: array}) and, per run,
gradient accumulators and AdamW state sized to that run's adapter (its targets, its rank) or, for full
fine-tuning, to the whole model. `forward_backward` fuses datums of any number of LoRA runs into one
set of packed micro-batches and adds each run's slice of the gradient to its accumulator (Tinker's sum
semantics: gradients add up until `optim_step`). `optim_step` touches only its own run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import threading
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tx.engine import train_step as ts
from tx.engine.bank import AdapterBank, HostRun
from tx.engine.batching import PackedBatch, halve_rows
from tx.engine.memory_guard import ProgramTooLarge
from tx.engine.train_batch import (
    Example,
    build_batch,
    gather_expert_load,
    make_example,
    plan_rows,
    request_results,
    scatter_outputs,
    slot_parts,
)
from tx.gather import packed_to_device, packed_to_host, to_host
from tx.lora.params import LoRAParam
from tx.lora.select import select, take_adapters
from tx.lora.slots import targets_from_flags
from tx.models.causal_lm import CausalLM
from tx.models.qwen3_5 import Qwen3_5CausalLM
from tx.protocol import AdamParams, ForwardBackwardRequest, ForwardBackwardResult, LoraConfig, RequestError

log = logging.getLogger("tx.engine")
Flat = ts.Flat
HYPER_PARAMS = ("learning_rate", "b1", "b2", "eps", "weight_decay", "grad_clip_norm")  # adam_step's inputs


def _hyper_params(values: dict[str, float]) -> dict[str, np.float32]:
    """`adam_step`'s hyper-parameters as numpy float32 scalars: the call moves them to the device with its other
    inputs (six `jnp.asarray` first cost 0.45 ms of dispatch per optim_step here, 10x the call's own)."""
    return {name: np.float32(values[name]) for name in HYPER_PARAMS}


def _zero_hyper_params() -> dict[str, np.float32]:  # the warm-up compiles with the same kind of inputs
    return _hyper_params(dict.fromkeys(HYPER_PARAMS, 0.0))


def lora_targets(cfg: LoraConfig) -> frozenset[str]:
    return targets_from_flags(cfg.train_attn, cfg.train_mlp, cfg.train_unembed)


@dataclasses.dataclass
class Run:
    run_id: str
    slot: int  # adapter slot; 0 for full fine-tuning (its rows use no adapter)
    lora: LoraConfig | None
    grads: Flat
    opt_state: Any
    params: Flat | None = None  # full fine-tuning: the run's own copy of every base weight
    step: int = 0

    @property
    def resident(self) -> bool:
        """False while a LoRA run is paged out to host memory (slot 0, state in `AdapterBank.host`)."""
        return self.lora is None or self.slot != 0


class SharedNotFinite(Exception):
    """A fused batch's gradient holds inf or NaN. One run's values (loss weights near float32's limit, an
    adapter trained to huge values) reach every slot's gradient through products where they meet zeros
    (0 * inf is NaN): the batch runs again, each run's rows apart, so that only that run's gradient is."""


class Trainer:
    """`bank`: the model's adapter bank (`tx.engine.bank`), the one writer of adapter slots."""

    def __init__(self, model: CausalLM | Qwen3_5CausalLM, bank: AdapterBank, micro_batch_tokens: int = 8192) -> None:
        graphdef, _, base = nnx.split(model, LoRAParam, ...)  # type: ignore[misc]
        self.steps = ts.StepFunctions(graphdef, bank.roles)
        self.bank = bank
        self.base = {p: jax.device_put(v, v.sharding) for p, v in ts.flat(base).items()}
        sharding = next(iter(self.base.values())).sharding
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        # Where run state lives when no mesh is given: committed to the weights' device, as program
        # outputs are (an uncommitted input is another compile key: one more compile per program).
        self._replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else sharding
        self.config = model.config
        self.micro_batch_tokens = micro_batch_tokens
        self.runs: dict[str, Run] = {}
        self._warm_up_thread: threading.Thread | None = None

    @property
    def max_rank(self) -> int:
        return self.bank.max_rank

    # ---- runs -------------------------------------------------------------------------------------

    def create_lora_run(self, run_id: str, cfg: LoraConfig, slot: int) -> Run:
        """A fresh adapter in `slot`, initialised as PEFT does (so training starts at the base model), from
        `cfg.seed`, else from the run's id (`init_seed`)."""
        targets = lora_targets(cfg)
        self.bank.init(slot, cfg.rank, cfg.alpha, targets, init_seed(run_id, cfg.seed))
        slot_, roles = jnp.int32(slot), self.bank.roles
        stacks = {p: v for p, v in self.bank.arrays.items() if p[-2] in targets}
        params = ts.new_run_params(stacks, slot_, cfg.rank, frozenset(p for p in stacks if roles.is_a(p)))
        # Placed as `adam_step` returns them (replicated over the mesh), or the second step recompiles
        # `accumulate_slot` and `adam_step` for the new placement (+0.6 s on `small`).
        grads, opt_state = self._placed_like(ts.fresh_state(params), {})
        run = Run(run_id, slot, cfg, grads, opt_state)
        self.runs[run_id] = run
        lora = dict(self.bank.arrays)
        # A gradient over the compact stack `lora_grad` returns for a batch of this run alone.
        alone = select([slot], self.bank.scale)
        assert alone is not None
        shapes = jax.eval_shape(lambda weights: take_adapters(weights, alone, roles), lora)
        compact = self._placed_like(ts.zeros_of(shapes), {})
        self._warm_up(
            [
                (ts.copy_weights, (run.grads,)),  # the accumulators saved before each batch
                (ts.accumulate_slot, (run.grads, compact, jnp.int32(0), roles)),
                (ts.read_slot_params, (lora, slot_, run.grads, roles)),
                (ts.adam_step, (params, run.opt_state, run.grads, _zero_hyper_params())),
                (ts.write_slot_params, (lora, slot_, params, roles)),
            ]
        )
        return run

    def _warm_up(self, programs: list[tuple[Any, tuple]]) -> None:
        """Compile, on another thread, the small programs a new run's first step needs besides the
        gradient (for a LoRA run: accumulating its slice of a one-adapter gradient, reading its adapter,
        AdamW, writing it back; 0.8 s of compiles on `small`). Their shapes are known at creation, and the
        first forward_backward spends its first seconds compiling the gradient program on one core.
        Lowering reads only shapes and placements (arrays donated meanwhile are fine) and fills the same
        cache a call with these arguments would."""
        self.await_warm_up()

        def compile_all() -> None:
            for program, args in programs:
                try:
                    program.lower(*args).compile()
                except Exception as err:  # only a head start: the real call compiles what this missed
                    log.debug("warm-up compile failed: %s", err)

        self._warm_up_thread = threading.Thread(target=compile_all, name="tx-warm-up", daemon=True)
        self._warm_up_thread.start()

    def await_warm_up(self) -> None:
        """Wait for a pending warm-up compile (before a program it compiles runs, so nothing compiles twice)."""
        thread, self._warm_up_thread = self._warm_up_thread, None
        if thread is not None:
            thread.join()

    def create_full_run(self, run_id: str) -> Run:
        params = ts.copy_weights(self.base)
        grads, opt_state = self._placed_like(ts.fresh_state(params, jnp.float32), params)
        run = Run(run_id, 0, None, grads, opt_state, params)
        self.runs[run_id] = run
        # `params` stands in for the gradient `full_grad` returns (same shapes, dtypes and placement).
        self._warm_up(
            [
                (ts.accumulate_full, (grads, params)),
                (ts.adam_step, (params, opt_state, grads, _zero_hyper_params())),
            ]
        )
        return run

    def reset_optimizer(self, run: Run) -> None:
        """A fresh AdamW state for `run` (a weights-only `load_state`), placed as a new run's is."""
        params = self.run_params(run)
        full = run.lora is None
        state = ts.fresh_state(params, jnp.float32 if full else None)
        _, run.opt_state = self._placed_like(state, params if full else {})
        run.step = 0

    def _placed_like(self, state: Any, params: Flat) -> Any:
        """A new run's (grads, optimizer state) placed as `adam_step` will return them: each per-weight leaf
        like its weight in `params`, everything else (LoRA runs, counters) replicated over the mesh.
        Otherwise the second step recompiles `accumulate_*` and `adam_step` for the new placement
        (measured +0.6 s on `small`)."""
        shardings = {p: v.sharding for p, v in params.items()}

        def placement(path: tuple, _: Any) -> jax.sharding.Sharding:
            keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in shardings]
            return shardings[keys[-1]] if keys else self._replicated

        # One transfer call for the whole tree: a page-in moves a run's every leaf (per-leaf calls were
        # 6.5 ms of a tiny run's 11.7 ms page move).
        return jax.device_put(state, jax.tree_util.tree_map_with_path(placement, state))

    def drop_run(self, run_id: str) -> Run:
        run = self.runs.pop(run_id)
        self.bank.forget_run(run_id)
        if run.lora is not None and run.resident:
            self.bank.clear(run.slot)
        return run

    def page_out(self, run_id: str) -> HostRun:
        """Move a LoRA run's adapter, gradient accumulators and AdamW state to host memory (exact copies)
        and give its slot back to the bank's table."""
        run = self.runs[run_id]
        self.await_warm_up()
        params, grads, opt_state = packed_to_host((self.run_params(run), run.grads, run.opt_state))
        host = self.bank.keep_run(run_id, HostRun(params, grads, opt_state))
        self.bank.clear(run.slot)
        self.bank.release(run_id)
        run.slot, run.grads, run.opt_state = 0, {}, None
        return host

    def page_in(self, run_id: str, slot: int) -> None:
        """Bring a paged-out run back into `slot` (allocated to it in the bank's table), placed as before."""
        run = self.runs[run_id]
        assert run.lora is not None
        host = self.bank.host[run_id]  # dropped only once on the device: a failed copy leaves the run paged out
        # As `_placed_like` places a LoRA run's state: every leaf replicated (one transfer for all of them).
        params, grads, opt_state = packed_to_device((host.params, host.grads, host.opt_state), self._replicated)
        self.bank.set_scale(slot, run.lora.rank, run.lora.alpha / run.lora.rank)
        self.bank.write(slot, params)  # the whole slot: what the adapter does not train is written zero
        self.bank.take_run(run_id)
        run.slot, run.grads, run.opt_state = slot, grads, opt_state

    def run_params(self, run: Run) -> Flat:
        if run.params is not None:
            return run.params
        return self.bank.read(run.slot, run.grads)

    def set_run_params(self, run: Run, params: Flat) -> None:
        if run.lora is None:
            run.params = params
        else:
            self.bank.write(run.slot, params)

    # ---- forward / backward -----------------------------------------------------------------------

    def forward_backward(self, work: Sequence[tuple[str, ForwardBackwardRequest]]) -> list[ForwardBackwardResult]:
        """Run requests of LoRA runs fused (or of one full fine-tuning run); gradients unless forward_only."""
        steps = self.forward_backward_steps(work)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def forward_backward_steps(
        self, work: Sequence[tuple[str, ForwardBackwardRequest]]
    ) -> Generator[None, None, list[ForwardBackwardResult]]:
        """`forward_backward` one micro-batch at a time: pauses after each, returns the results at the end,
        so the runner can interleave a large request with other runs' work (the runs' gradients stay apart;
        a failure part-way undoes this work's gradients as `forward_backward` does)."""
        examples: list[Example] = []
        owner: list[int] = []
        for index, (run_id, req) in enumerate(work):
            run = self._run(run_id)
            config = dict(req.loss_fn_config or {})  # validated before it was queued (tx.api.validate)
            for datum in req.data:
                examples.append(make_example(datum, req.loss_fn, config, run.slot, not req.forward_only))
                owner.append(index)
        full = {self.runs[r].run_id for r, _ in work if self.runs[r].lora is None}
        if full and len({r for r, _ in work}) > 1:
            raise ValueError("a full fine-tuning run cannot share a batch with other runs")
        outputs: dict[int, dict[str, np.ndarray]] = {}
        if examples:
            training = {r for r, req in work if not req.forward_only}
            with self._undo_on_error(training):
                yield from self._run_batches(examples, [work[o] for o in owner], outputs)
        return request_results(work, examples, owner, outputs)

    @contextlib.contextmanager
    def _undo_on_error(self, run_ids: set[str]) -> Iterator[None]:
        """Leave the runs' accumulated gradients as they were if the batch fails part-way, so that its
        requests can run again one by one. LoRA accumulators are small and copied first (the
        accumulation donates them); a full fine-tuning run's are as large as the model, so a failure
        after part of its batch was added discards its accumulated gradients, and says so."""
        runs = [self.runs[r] for r in sorted(run_ids)]
        saved = {run.run_id: ts.copy_weights(run.grads) for run in runs if run.lora is not None}  # one program
        try:
            yield
        except BaseException as err:  # GeneratorExit too: a long request dropped part-way adds nothing
            for run in runs:
                run.grads = saved[run.run_id] if run.lora is not None else jax.tree.map(jnp.zeros_like, run.grads)
            if isinstance(err, Exception) and any(run.lora is None for run in runs):
                raise RequestError(
                    f"forward_backward failed ({type(err).__name__}: {err}); the gradients accumulated since "
                    "the last optim_step were discarded",
                    "server",
                ) from err
            raise

    def _run_batches(self, examples: list[Example], work_of: list, outputs: dict) -> Iterator[None]:
        plan = plan_rows(examples, self.micro_batch_tokens)
        for batch in plan.batches:
            if batch.segments:
                self._run_fitting(examples, batch, plan.lengths, work_of, outputs)
                yield

    def _run_fitting(
        self, examples: list[Example], batch: PackedBatch, lengths: tuple[int, ...], work_of: list, outputs: dict
    ) -> None:
        """Run `batch`, or, when its program would not fit the memory free (`ProgramTooLarge`, raised before
        it runs), its rows in two halves, and so on down to one row, which fails the request if it still
        does not fit."""
        try:
            self._run_batch(examples, batch, work_of, outputs)
        except SharedNotFinite:
            log.warning("a fused batch's gradient is not finite: running its %d runs' rows apart", len(work_of))
            for part in slot_parts(examples, batch):
                self._run_fitting(examples, part, lengths, work_of, outputs)
        except ProgramTooLarge as err:
            halves = halve_rows(batch, lengths)
            if not halves:
                raise RequestError(
                    f"one row of {batch.row_tokens} tokens does not fit this machine's free memory ({err}): send "
                    "shorter datums, or restart the server with --remat (activations recomputed in the backward)",
                    "user",
                ) from err
            log.warning("a %d x %d training batch does not fit (%s): running it in halves", *batch.shape, err)
            for half in halves:
                self._run_fitting(examples, half, lengths, work_of, outputs)

    def _run_batch(self, examples: list[Example], batch: PackedBatch, work_of: list, outputs: dict) -> None:
        inputs, datums = build_batch(examples, batch, self.bank.scale)
        present = {work_of[d][0] for d in datums}
        needs_grad = {work_of[d][0] for d in datums if not work_of[d][1].forward_only}
        out = self._execute(inputs, present, needs_grad)
        scatter_outputs(batch, to_host(out.target_logprobs), to_host(out.token_loss), outputs)
        if out.expert_picks is not None and self.config.moe is not None:
            gather_expert_load(batch, to_host(out.expert_picks), self.config.moe.experts, outputs)

    def _execute(self, inputs: ts.TrainBatch, present: set[str], needs_grad: set[str]) -> ts.StepOutputs:
        full = [self.runs[r] for r in present if self.runs[r].lora is None]
        base = full[0].params if full else self.base
        if not needs_grad:
            return self.steps.forward(self.bank.arrays, base, inputs)
        if full:  # a full fine-tuning run is alone in its batch
            grads, out = self.steps.full_grad(self.bank.arrays, base, inputs)
            self.await_warm_up()
            full[0].grads = ts.accumulate_full(full[0].grads, grads)
            return out
        grads, out = self.steps.lora_grad(self.bank.arrays, base, inputs)
        self.await_warm_up()
        if len(present) > 1 and not to_host(ts.all_finite(grads)):
            raise SharedNotFinite  # before any run's accumulator took its share
        assert inputs.adapters is not None  # a LoRA run's rows always carry its slot
        active = [int(s) for s in np.asarray(inputs.adapters.active)]
        for run_id in sorted(needs_grad):
            run = self.runs[run_id]
            index = jnp.int32(active.index(run.slot))  # the run's place in the compact stack
            run.grads = ts.accumulate_slot(run.grads, grads, index, self.bank.roles)
        return out

    # ---- optimizer ----------------------------------------------------------------------------------

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        run = self._run(run_id)
        self.await_warm_up()
        hp = {
            "learning_rate": adam.learning_rate,
            "b1": adam.beta1,
            "b2": adam.beta2,
            "eps": adam.eps,
            "weight_decay": adam.weight_decay,
            "grad_clip_norm": adam.grad_clip_norm,
        }
        assert tuple(hp) == HYPER_PARAMS
        params, run.opt_state, run.grads, norm, applied = ts.adam_step(
            self.run_params(run), run.opt_state, run.grads, _hyper_params(hp)
        )
        self.set_run_params(run, params)
        if not math.isfinite(norm := float(norm)):
            raise RequestError(
                f"the accumulated gradient is not finite (norm {norm}): the step was not applied and the gradient "
                "was dropped; look for extreme values in the batches' loss_fn_inputs (weights, advantages)",
                "user",
            )
        if not bool(applied):
            raise RequestError(
                f"the update is not finite with these adam_params (learning_rate {adam.learning_rate}, eps "
                f"{adam.eps}, weight_decay {adam.weight_decay}; gradient norm {norm}): the step was not applied "
                "and the gradient was dropped",
                "user",
            )
        run.step += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate}

    def _run(self, run_id: str) -> Run:
        if run_id not in self.runs:
            raise RequestError(f"unknown model_id {run_id!r}", "user")
        return self.runs[run_id]


def init_seed(run_id: str, seed: int | None) -> int:
    """The seed of a new adapter's A: the caller's, else one drawn from the run's id. Every run created
    without a seed had started from the same A (seed 0), so repeats of an experiment were not independent.
    The id, not a random draw: every process of a multi-host engine must initialise the same adapter."""
    if seed is not None:
        return seed
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big")
