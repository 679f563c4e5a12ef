"""Mixed ranks on one server: the adapter bank's stacks follow the ranks on the device, not --max-lora-rank.

Two real `JaxRunner`s over one tiny Qwen3: `wide` allows rank 128, `narrow` only rank 8 (a single-rank
server). A rank-8 run on `wide` trains, samples and costs memory as on `narrow`, also while a rank-128
run shares its batches; a run paged out at one stack width and back at another continues bit for bit;
replaying a mixed-rank workload compiles nothing new.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from test_paging import _fb, _item, _ok, _run, _state, _touch

from tx.engine.compiles import compile_count
from tx.engine.round_notes import PAGED_IN
from tx.engine.runner import JaxRunner
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimStepRequest,
    RequestError,
    SampleRequest,
    SamplingParams,
    SaveSamplerRequest,
    UnloadModelRequest,
    WeightsRef,
)

SLOTS = 3


def _build(hf_models, tmp_path_factory, max_rank: int) -> JaxRunner:  # type: ignore[no-untyped-def]
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    model_dir, _ = hf_models()
    config = EngineConfig(
        data_dir=tmp_path_factory.mktemp(f"ranks{max_rank}"), base_model=str(model_dir), dtype="float32",
        adapters=AdapterConfig(SLOTS, max_rank, max_runs=8), sampler=SamplerConfig(max_rows=4, max_seq_len=64),
    )  # fmt: skip
    return build_runner(config)[0]


@pytest.fixture(scope="module")
def wide(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    yield _build(hf_models, tmp_path_factory, 128)


@pytest.fixture(scope="module")
def narrow(hf_models, tmp_path_factory) -> Iterator[JaxRunner]:  # type: ignore[no-untyped-def]
    yield _build(hf_models, tmp_path_factory, 8)


def _create(runner: JaxRunner, name: str, rank: int, seed: int) -> None:
    _ok(runner, _item("create_model", name, CreateModelRequest("m", LoraConfig(rank, 16.0, seed=seed))))


def _optim(runner: JaxRunner, *names: str) -> None:
    _ok(runner, *(_item("optim_step", n, OptimStepRequest(AdamParams(learning_rate=1e-2))) for n in names))


def _steps(runner: JaxRunner, names: tuple[str, ...], tokens: list[int]) -> list[ForwardBackwardResult]:
    """forward_backward of every run in `names`, submitted together (one fused batch), then their optim_steps."""
    results = _ok(runner, *(_item("forward_backward", n, _fb(tokens)) for n in names))
    _optim(runner, *names)
    return results


def _sample(runner: JaxRunner, name: str) -> tuple[list[int], list[float]]:
    _ok(runner, _item("save_weights_for_sampler", name, SaveSamplerRequest(f"snap-{name}")))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    request = SampleRequest([1, 2, 3], 1, params, "m", weights=WeightsRef(f"snap-{name}"))
    sequence = _ok(runner, _item("sample", "s", request))[0].sequences[0]
    return sequence.tokens, sequence.logprobs


def _unload(runner: JaxRunner, *names: str) -> None:
    _ok(runner, *(_item("unload_model", n, UnloadModelRequest()) for n in names))
    for info in [info for info in runner.slots if info.kind == "sampler"]:
        runner.bank.clear(runner.bank.release(info.owner).slot)
    runner.bank.host_snapshots.clear()
    assert len(runner.slots) == 0 and not runner.bank.host


DATA = ([5, 6, 7, 8, 9], [9, 3, 4, 11, 2, 7])


def test_rank_8_and_rank_128_train_and_sample_side_by_side(wide: JaxRunner, narrow: JaxRunner) -> None:
    """A rank-8 run on the max-128 server holds the memory it holds on a max-8 server; fused with a rank-128
    run it computes what it computes there (logprobs, weights, sampled tokens); the rank-128 run computes
    what it computes alone; when the rank-128 run leaves, the stacks narrow back."""
    _create(wide, "r8", 8, seed=3)
    _create(narrow, "r8", 8, seed=3)
    assert wide.bank.stack_rank == narrow.bank.stack_rank == 8
    assert wide.resident_bytes() == narrow.resident_bytes()
    _create(wide, "r128", 128, seed=5)
    assert wide.bank.stack_rank == 128 and wide.bank.device_bytes() == 16 * narrow.bank.device_bytes()
    fused = [_steps(wide, ("r8", "r128"), tokens) for tokens in DATA]
    for (r8, _), tokens in zip(fused, DATA, strict=True):
        alone = _steps(narrow, ("r8",), tokens)[0]
        np.testing.assert_allclose(r8.outputs[0]["logprobs"], alone.outputs[0]["logprobs"], atol=1e-5, rtol=0)
    # Summation order differs between the stack widths, and AdamW's m / sqrt(v) lifts that noise where a
    # gradient is near zero (1.2e-6 on one weight of 2048 on a Zen 5 EPYC): far below one step of 1e-2.
    for got, want in zip(_state(wide, "r8"), _state(narrow, "r8"), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    tokens_8, logprobs_8 = _sample(wide, "r8")
    reference_8 = _sample(narrow, "r8")
    assert tokens_8 == reference_8[0]
    np.testing.assert_allclose(logprobs_8, reference_8[1], atol=1e-5)
    sampled_128 = _sample(wide, "r128")
    _unload(wide, "r8", "r128")
    _unload(narrow, "r8")
    assert wide.bank.stack_rank == 8 and wide.bank.device_bytes() == narrow.bank.device_bytes()
    _create(wide, "r128-alone", 128, seed=5)
    alone_128 = [_steps(wide, ("r128-alone",), tokens)[0] for tokens in DATA]
    for (_, r128), want in zip(fused, alone_128, strict=True):
        np.testing.assert_allclose(r128.outputs[0]["logprobs"], want.outputs[0]["logprobs"], atol=1e-5, rtol=0)
    tokens_128, logprobs_128 = _sample(wide, "r128-alone")
    assert sampled_128[0] == tokens_128 and not np.allclose(sampled_128[1], logprobs_8, atol=1e-3)
    np.testing.assert_allclose(sampled_128[1], logprobs_128, atol=1e-5)
    _unload(wide, "r128-alone")


def _mixed_paging(runner: JaxRunner, tag: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two rank-8 twins; one is paged out while a rank-128 run widens the stacks to 128 and back in after it
    left (stacks at 16, for a rank-16 run); it continues bit for bit as its twin that stayed."""
    stay, moved, big, other = (f"{n}-{tag}" for n in ("stay", "moved", "big", "other"))
    _create(runner, stay, 8, seed=3)
    _create(runner, moved, 8, seed=3)
    for name in (stay, moved):
        _steps(runner, (name,), DATA[0])
    _create(runner, big, 128, seed=5)
    _steps(runner, (big,), DATA[0])
    assert runner.bank.stack_rank == 128
    _touch(runner, stay)
    _touch(runner, big)
    with caplog.at_level(logging.INFO, logger="tx.engine"):
        _create(runner, other, 16, seed=7)  # a fourth owner on three slots: the least recently used goes out
    host_bytes = runner.bank.host[moved].nbytes
    assert host_bytes > 0 and f"paged {moved} out to {host_bytes / 2**20:.2f} MiB of host memory" in caplog.text
    _ok(runner, _item("unload_model", big, UnloadModelRequest()))
    assert runner.bank.stack_rank == 16
    _touch(runner, stay)
    results = {name: _steps(runner, (name,), DATA[1])[0] for name in (moved, stay)}
    assert results[moved].metrics[PAGED_IN] == host_bytes and PAGED_IN not in results[stay].metrics
    np.testing.assert_array_equal(results[moved].outputs[0]["logprobs"], results[stay].outputs[0]["logprobs"])
    for got, want in zip(_state(runner, moved), _state(runner, stay), strict=True):
        np.testing.assert_array_equal(got, want)
    _unload(runner, stay, moved, other)
    assert runner.bank.stack_rank == 8


def test_a_rank_above_the_limit_names_the_flag(wide: JaxRunner) -> None:
    """The limit is --max-lora-rank, not the stacks' current width (8 here): rank 128 fits, 129 is refused."""
    assert wide.bank.stack_rank == 8
    refused = _run(wide, _item("create_model", "r129", CreateModelRequest("m", LoraConfig(129, 16.0))))[0]
    assert isinstance(refused, RequestError) and "limit of 128" in str(refused)
    assert "--max-lora-rank 129" in str(refused) and wide.bank.stack_rank == 8 and not wide.trainer.runs


def test_paging_across_stack_widths_is_exact_and_compiles_once(
    wide: JaxRunner, caplog: pytest.LogCaptureFixture
) -> None:
    """The mixed-rank paging workload twice: the second time it compiles nothing (one program per width)."""
    _mixed_paging(wide, "a", caplog)
    jax.effects_barrier()
    before = compile_count()
    _mixed_paging(wide, "b", caplog)
    assert compile_count() == before
