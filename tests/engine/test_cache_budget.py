"""The decode cache stays within its byte budget: rows wait (or a request is split) rather than the cache
growing past the limit, and what is sampled does not change."""

from __future__ import annotations

import dataclasses

import jax
import psutil
import pytest
from test_sampler import CFG, LORA_SLOT, PROMPTS, Setup, char_decode, make_req, run, tokens_of

from tx.engine import cache_budget
from tx.engine.cache_budget import CacheBudget, cache_bytes_of, free_bytes
from tx.engine.sampler import Sampler
from tx.models.cache import decode_cache
from tx.protocol import RequestError


def _linear(rows: int, length: int) -> int:
    return rows * length * 10


def test_the_row_cap_is_the_largest_bucket_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=10 * 64 * 2)
    assert [fixed.row_cap(64, held_bytes=10**9), fixed.row_cap(32, 0), fixed.row_cap(16, 0)] == [2, 4, 8]
    assert fixed.row_cap(256, 0) == 1  # nothing fits: one row still runs
    free = CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=None)
    monkeypatch.setattr(cache_budget, "free_bytes", lambda devices: 10 * 64 * 4 / cache_budget.SHARE_OF_FREE)
    assert free.row_cap(64, held_bytes=0) == 4
    # what the cache holds now counts as free for it
    assert free.row_cap(64, held_bytes=10 * 64 * 4 / cache_budget.SHARE_OF_FREE) == 8


def test_a_fixed_limit_one_byte_short_of_a_bucket_leaves_it_out() -> None:
    budget = CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=10 * 64 * 4 - 1)
    assert budget.row_cap(64, held_bytes=10**9) == 2
    assert CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=10 * 64 * 4).row_cap(64, 0) == 4


def test_several_processes_without_a_flag_have_no_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """They must admit alike, and each sees its own free memory: no limit but `--decode-cache-gb`."""
    monkeypatch.setattr(cache_budget, "free_bytes", lambda devices: 1000)
    assert CacheBudget(_linear, (1, 2), limit_bytes=None).limit() == 450  # 45% of free (--decode-cache-gb's help)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    free = CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=None)
    assert free.limit() is None and free.row_cap(10**6, held_bytes=0) == 8
    assert CacheBudget(_linear, (1, 2, 4, 8), limit_bytes=640).limit() == 640


class _Device:
    def __init__(self, stats: dict | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict | None:
        return self.stats


def test_free_bytes_are_the_allocators_room_or_the_hosts() -> None:
    accelerators = {_Device({"bytes_limit": 100, "bytes_in_use": 30}), _Device({"bytes_limit": 50})}
    assert free_bytes(accelerators) == 70 + 50
    available = psutil.virtual_memory().available
    for host in ({_Device(None)}, {_Device({"bytes_in_use": 5})}, {_Device({"bytes_limit": 9}), _Device(None)}):
        assert abs(free_bytes(host) - available) < 2**28


def test_the_cache_bytes_are_those_of_the_cache_the_sampler_makes(qwen: Setup) -> None:
    for per_layer in (True, False):
        nbytes = cache_bytes_of(qwen.cfg, per_layer)
        made = decode_cache(qwen.cfg, 4, 32, per_layer)
        assert nbytes(4, 32) == sum(x.nbytes for x in jax.tree.leaves(made)) > 0
        assert nbytes(8, 32) == 2 * nbytes(4, 32) and nbytes(4, 64) == 2 * nbytes(4, 32)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("qwen-budget"), "qwen3", True, lora=True)


def test_rows_past_the_budget_wait_and_sample_the_same(qwen: Setup) -> None:
    """A budget of two rows at 64 positions: a five-sample request is split over the two rows and another
    waits its turn; every sequence equals what an unlimited sampler draws with the same seeds."""
    two_rows = cache_bytes_of(qwen.cfg, CFG.layer_cache)(2, 64)
    limited = Sampler(
        qwen.graphdef, lambda: qwen.weights, qwen.cfg, dataclasses.replace(CFG, cache_limit_bytes=two_rows), (),
        char_decode, qwen.fixed(),
    )  # fmt: skip

    def workload() -> dict:
        return {
            "five": (make_req(PROMPTS[2], 40, n=5, temperature=1.0, seed=7), LORA_SLOT),
            "three": (make_req(PROMPTS[3], 30, n=3, temperature=1.0, seed=8), 0),
        }

    shapes: list[tuple[int, int]] = []
    step = limited.step

    def watched() -> list:
        out = step()
        shapes.append(limited.cache_shape or (0, 0))
        return out

    limited.step = watched  # type: ignore[method-assign]
    got, _ = run(limited, workload())
    want, _ = run(qwen.sampler, workload())
    assert max(rows for rows, _ in shapes) == 2 and max(length for _, length in shapes) == 64
    for name in ("five", "three"):
        assert tokens_of(got[name]) == tokens_of(want[name])


def test_a_request_whose_one_row_passes_the_limit_with_the_sampler_idle_fails_naming_the_sizes(qwen: Setup) -> None:
    """One row always ran, whatever its cache: a model with a huge head dimension (an upload: 17 GB for one
    row at 1024 positions) took the machine down with one sample. Such a request now fails on its own,
    naming the sizes; one that fits runs beside it, and a shorter one of the same model runs."""
    one_row_at_32 = cache_bytes_of(qwen.cfg, CFG.layer_cache)(CFG.row_buckets[0], 32)
    tight = Sampler(
        qwen.graphdef, lambda: qwen.weights, qwen.cfg, dataclasses.replace(CFG, cache_limit_bytes=one_row_at_32),
        (), char_decode, qwen.fixed(),
    )  # fmt: skip
    got, _ = run(
        tight, {"long": (make_req(PROMPTS[0], 50), 0), "short": (make_req(PROMPTS[0], 20, temperature=1.0, seed=5), 0)}
    )
    assert isinstance(got["long"], RequestError) and got["long"].category == "user", got["long"]
    assert "GiB of decode cache" in got["long"].message and "--decode-cache-gb" in got["long"].message
    assert tokens_of(got["short"]) == tokens_of(
        run(qwen.sampler, {"short": (make_req(PROMPTS[0], 20, temperature=1.0, seed=5), 0)})[0]["short"]
    )
    budget = CacheBudget(_linear, (1, 2), limit_bytes=10 * 64)
    budget.check_alone(64)  # exactly at the limit: runs
    with pytest.raises(RequestError):
        budget.check_alone(65)


def test_without_a_flag_a_request_is_refused_only_past_what_an_idle_machine_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Free memory shrinks while other models load; a request refused for that failed for good (the SDK does
    not retry a user error). Without a flag the bound is 45% of all the memory, not of the free memory."""
    budget = CacheBudget(_linear, (1, 2), limit_bytes=None)
    monkeypatch.setattr(cache_budget, "free_bytes", lambda devices: 0)  # the machine busy now
    monkeypatch.setattr(cache_budget, "total_bytes", lambda devices: 1000 / cache_budget.SHARE_OF_FREE)
    budget.check_alone(100)  # 1000 bytes: what an idle machine gives
    with pytest.raises(RequestError):
        budget.check_alone(101)
