"""`RunMemory`, the server's count of LoRA run state against `--max-run-state-gb`, at its edges (the
engine-level behaviour, refusal through the runner and paging, is in `test_paging.py`)."""

import os

import jax.numpy as jnp
import pytest

from tx.engine.run_memory import RunMemory, default_limit_bytes, gb, lora_run_bytes
from tx.protocol import RequestError


def test_the_default_limit_is_a_quarter_of_physical_memory() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_limit_bytes() == int(physical * 0.25)
    assert RunMemory().limit_bytes == default_limit_bytes()


def test_a_limit_of_one_byte_is_the_smallest() -> None:
    assert RunMemory(1).limit_bytes == 1
    with pytest.raises(ValueError, match="--max-run-state-gb must be > 0"):
        RunMemory(0)


def test_admission_fits_up_to_the_limit_exactly_and_counts_nothing_when_refused() -> None:
    memory = RunMemory(100)
    memory.admit("a", 60)
    memory.admit("b", 40)  # exactly at the limit
    with pytest.raises(RequestError, match="--max-run-state-gb") as err:
        memory.admit("c", 1)
    assert err.value.category == "user" and memory.held == {"a": 60, "b": 40}
    memory.release("b")
    memory.release("b")  # twice: nothing left to release
    assert memory.used() == 60


def test_admitting_a_run_again_replaces_its_count() -> None:
    """A run counted again (its state rebuilt at another rank) is measured without its old bytes."""
    memory = RunMemory(100)
    memory.admit("a", 60)
    memory.admit("a", 90)
    assert memory.held == {"a": 90} and memory.used() == 90


def test_a_lora_runs_bytes_are_its_adapter_gradients_and_moments() -> None:
    grads = {"a": jnp.zeros((4, 8), jnp.float32), "b": jnp.zeros((8, 2), jnp.float32)}  # 192 bytes
    moments = (jnp.zeros((4, 8)), jnp.zeros((8, 2)), jnp.zeros((4, 8)), jnp.zeros((8, 2)), jnp.zeros((), jnp.int32))
    assert lora_run_bytes(grads, moments) == 2 * 192 + 2 * 192 + 4


def test_sizes_read_in_gb_from_one_gb_and_in_mb_below() -> None:
    assert gb(10**9) == "1.00 GB" and gb(10**9 - 10**6) == "999.00 MB" and gb(2_500_000_000) == "2.50 GB"
