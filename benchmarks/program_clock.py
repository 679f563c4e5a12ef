"""Where a round's wall time goes: inside compiled programs, or on the host around them.

`ProgramClock.install()` replaces `jax.jit` (call it before `tx` is imported: the engine builds its
programs at import and at start-up) with a wrapper whose calls, outside a trace, wait for their outputs
(`block_until_ready`) and add the wait to `program_s`. Every program the engine runs is a `jax.jit`
function, so `program_s` is the time its programs ran, and a round's wall time minus `program_s` (and minus
`own_s`, the clock's own bookkeeping) is the host's: Python, each call's dispatch, eager `jnp` operations,
copies between host and device, SQL. Waiting after each program serialises host and device, so no host
work hides behind a running program: the host time is counted in full, as it is paid on an accelerator
whose programs take milliseconds. One exception makes it an upper bound on CPU: XLA's CPU client runs a
small program inline in the calling thread (the call returns when it is done), so that run counts as host
time. With `on` False the wrapper only passes calls through.

`Phases` attributes host time to named functions: each wrapped call's wall time net of the programs
that ran inside it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax


class ProgramClock:
    def __init__(self) -> None:
        self.on = True
        self.program_s = 0.0  # waiting for programs' outputs
        self.own_s = 0.0  # the wrapper's own bookkeeping (looking for tracers among the outputs)
        self.calls = 0

    def install(self) -> None:
        real = jax.jit

        def jit(fun: Callable[..., Any], **kwargs: Any) -> Timed:
            return Timed(real(fun, **kwargs), self)

        jax.jit = jit  # type: ignore[assignment]

    def reset(self) -> None:
        self.program_s = self.own_s = 0.0
        self.calls = 0

    def spent(self) -> float:
        """Seconds not the host's: programs and the clock's own bookkeeping."""
        return self.program_s + self.own_s


class Timed:
    """A jitted function whose calls are timed by `clock` (attributes such as `lower` pass through)."""

    def __init__(self, jitted: Any, clock: ProgramClock) -> None:
        self.jitted, self.clock = jitted, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.jitted(*args, **kwargs)
        clock = self.clock
        if not clock.on:
            return out
        start = time.perf_counter()
        leaves = jax.tree.leaves(out)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # called while tracing another program
            return out
        ready = time.perf_counter()
        jax.block_until_ready(leaves)
        clock.program_s += time.perf_counter() - ready
        clock.own_s += ready - start
        clock.calls += 1
        return out


class Phases:
    """Host seconds per named function, net of the programs inside it (`seconds[name]`)."""

    def __init__(self, clock: ProgramClock) -> None:
        self.clock = clock
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Replace `owner.attr` (a module's function, a class's method, an instance's bound method)."""
        inner, clock, seconds = getattr(owner, attr), self.clock, self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, spent = time.perf_counter(), clock.spent()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start - (clock.spent() - spent)

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
