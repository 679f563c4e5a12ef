"""Counts XLA compilations and turns on JAX's persistent compilation cache.

Every backend compile in the process bumps `compile_count()`; tests replay a workload and assert the
count does not grow, and the server logs each compile so a slow first request is explained.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import jax

log = logging.getLogger("tx.engine")

# XLA options for the training programs. XLA:CPU's newer fusion emitters cost compile time that a
# training step does not win back: with them off the LoRA gradient program of `small` compiles in 1.6
# instead of 2.2 s and runs within 2% of the speed. Decode keeps the default (the emitters make its
# steps 5-11% faster). Unknown to other backends' compilers, which ignore CPU options.
TRAIN_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration_secs: float, **_: str | int) -> None:
    global _count
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _count += 1
        if duration_secs > 1.0:
            log.info("compiled a program in %.1f s", duration_secs)


def install_counter() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    install_counter()
    return _count


def enable_persistent_cache(directory: Path) -> None:
    """Cache compiled programs on disk so a restarted server skips compiles it has paid for before."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
