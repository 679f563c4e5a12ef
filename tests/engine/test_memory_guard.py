"""A training batch whose compiled program would not fit the memory free runs in smaller pieces, with the
same results; a single row that does not fit fails its request by name and leaves the run as it was."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_trainer import assert_same_training, make_datum, random_lora

from tx.engine import memory_guard
from tx.engine.bank import AdapterBank
from tx.engine.batching import PackedBatch, Segment, halve_rows
from tx.engine.trainer import Trainer
from tx.lora.layers import LoRASpec
from tx.models.weights import load_model
from tx.protocol import ForwardBackwardRequest, LoraConfig, RequestError


@pytest.fixture(scope="module")
def setup(hf_models):  # type: ignore[no-untyped-def]
    path, _ = hf_models("qwen3", 2, False)
    model, cfg = load_model(str(path), lora=LoRASpec(slots=4, max_rank=8), progress=False)
    return model, cfg


def _rows_of_one(cfg, rows: int, length: int = 100) -> ForwardBackwardRequest:  # type: ignore[no-untyped-def]
    """Datums too long to share a row: one packed row each."""
    rng = np.random.RandomState(3)
    return ForwardBackwardRequest(
        [make_datum(rng, cfg.vocab_size, length, "cross_entropy") for _ in range(rows)], "cross_entropy"
    )


def test_halving_keeps_every_segment_and_stops_at_one_row() -> None:
    batch = PackedBatch(8, 128, tuple(Segment(d, d, 0, 100) for d in range(5)))
    halves = halve_rows(batch, (100,) * 5)
    assert len(halves) == 2 and all(max(s.row for s in h.segments) < 3 for h in halves)  # 5 rows: 3 + 2
    assert sorted(s.datum for h in halves for s in h.segments) == list(range(5))
    assert halve_rows(PackedBatch(2, 128, (Segment(0, 0, 0, 50), Segment(1, 0, 50, 50))), (50, 50)) == ()


def test_a_batch_too_large_for_the_free_memory_runs_in_halves_alike(setup, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    model, cfg = setup
    req = _rows_of_one(cfg, 4)
    outs, needs = [], []
    for squeeze in (False, True):
        trainer = Trainer(model, AdapterBank.of(model), micro_batch_tokens=1 << 16)
        run = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
        random_lora(trainer, run, 7)
        if squeeze:  # the 4-row program no longer fits; one of half as many rows does
            monkeypatch.setattr(memory_guard._LastRun, "held", 0)  # the first trainer's run: memory gone elsewhere
            devices = len(run.grads[next(iter(run.grads))].sharding.device_set)
            free = int(max(needs) * devices / memory_guard.SHARE_OF_FREE) - 1
            monkeypatch.setattr(memory_guard, "free_bytes", lambda _, free=free: free)
        with caplog.at_level(logging.WARNING, logger="tx.engine"):
            outs.append((trainer.forward_backward([("a", req)])[0], run.grads))
        needs = list(trainer.steps.lora_grad._check._need.values())
    assert "running it in halves" in caplog.text
    assert_same_training(*outs[0], *outs[1])


def test_one_row_that_does_not_fit_fails_by_name_and_leaves_the_run(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
    monkeypatch.setattr(memory_guard, "free_bytes", lambda _: 1000)
    monkeypatch.setattr(memory_guard._LastRun, "held", 0)  # no earlier run's memory to reuse
    with pytest.raises(RequestError) as refused:
        trainer.forward_backward([("a", _rows_of_one(cfg, 1))])
    assert refused.value.category == "user" and "--remat" in str(refused.value)
    assert "one row of 128 tokens does not fit" in str(refused.value)
    assert all(not np.asarray(g).any() for g in run.grads.values())


def test_a_program_that_has_run_is_not_refused_later(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CPU the memory a program's run took stays with the process (not free to the OS) until another
    program runs and reuses it: the free memory shrinking after that run refuses neither the same program nor
    a smaller one, while a larger new one is still checked."""
    model, cfg = setup
    trainer = Trainer(model, AdapterBank.of(model))
    trainer.create_lora_run("a", LoraConfig(rank=4), slot=1)
    trainer.forward_backward([("a", _rows_of_one(cfg, 2))])
    monkeypatch.setattr(memory_guard, "free_bytes", lambda _: 1000)
    trainer.forward_backward([("a", _rows_of_one(cfg, 2))])  # the same shapes: runs
    trainer.forward_backward([("a", _rows_of_one(cfg, 1))])  # one row: fits in what the two-row run holds
    with pytest.raises(RequestError, match="does not fit"):
        trainer.forward_backward([("a", _rows_of_one(cfg, 1, length=300))])  # a new shape is still checked


def test_the_need_is_temporaries_and_outputs_less_what_aliases_the_arguments() -> None:
    """A program that writes a new array twice its argument's size needs at least that; one that updates its
    donated argument in place needs less than the argument (its output is the argument's buffer)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 16,), jnp.float32)
    doubled = jax.jit(lambda v: jnp.concatenate([v, v])).lower(x).compile()
    in_place = jax.jit(lambda v: v + 1, donate_argnums=0).lower(x).compile()
    assert memory_guard._assigned_bytes(doubled) >= 2 * x.nbytes
    assert 0 <= memory_guard._assigned_bytes(in_place) < x.nbytes


def test_each_device_counts_its_share_against_the_hosts_free_memory() -> None:
    assert memory_guard._total_need(100, {object(), object()}) == 200  # type: ignore[arg-type]


def test_a_program_fits_up_to_ninety_percent_of_the_free_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(memory_guard._LastRun, "held", 0)
    monkeypatch.setattr(memory_guard, "free_bytes", lambda devices: 1000)
    args = (jnp.ones(4),)
    for need, fits in ((900, True), (901, False)):
        monkeypatch.setattr(memory_guard, "_assigned_bytes", lambda compiled, need=need: need)
        check = memory_guard.MemoryCheck()
        if fits:
            assert check(jax.jit(jnp.sin), args, {}) is not None
        else:
            with pytest.raises(memory_guard.ProgramTooLarge, match="is free"):
                check(jax.jit(jnp.sin), args, {})
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # several processes: unchecked, nothing compiled
    monkeypatch.setattr(memory_guard, "_assigned_bytes", lambda compiled: pytest.fail("compiled"))
    assert memory_guard.MemoryCheck()(jax.jit(jnp.cos), args, {}) is None
