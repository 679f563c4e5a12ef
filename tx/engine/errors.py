"""Turn any exception raised while executing one work item into the `RequestError` its caller sees.

Containment rule: whatever an item raises fails that item only, with category `user` when the
item's own input caused it and `server` otherwise. Messages leave the server's absolute paths out:
a directory under a known root is shown relative to it, any other absolute path by its last part.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx.gather import to_host
from tx.lora.slots import SlotsExhausted
from tx.names import BadName
from tx.protocol import ErrorCategory, RequestError

# What stops the process instead of failing requests. Everything else that escapes fails the requests it
# concerns, a native extension's panic too: pyo3's PanicException (a `tokenizers` regex past its retry limit)
# derives from BaseException, and caught as Exception it killed the engine thread.
EXITS = (KeyboardInterrupt, SystemExit)

# Raised by our own checks on what the request asked for (not by device or I/O failures).
USER_ERRORS: tuple[type[Exception], ...] = (BadName, SlotsExhausted, FileNotFoundError, ValueError, MemoryError)
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^\s'\":,/]+/)*([^\s'\":,/]+)")


DISK_FULL = (
    "the server's disk is full: this request's files were not written (free space in the server's data "
    "directory, e.g. delete old checkpoints, and try again)"
)


def out_of_space(err: BaseException) -> bool:
    """ENOSPC from Python, or from orbax's tensorstore writes (a ValueError saying RESOURCE_EXHAUSTED)."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    return isinstance(err, ValueError) and "RESOURCE_EXHAUSTED" in str(err)


def damaged_checkpoint(kind: str, source: Path, part: str, exc: Exception) -> RequestError:
    """A checkpoint whose files cannot be read (truncated, garbled): named, with the reader's first line."""
    detail = str(exc).splitlines()[0][:200] if str(exc) else ""
    return RequestError(
        f"{kind} {source.name!r} cannot be read: damaged or incomplete {part} ({type(exc).__name__}: {detail}); "
        "save it again or use an earlier one",
        "server",
    )


def check_finite(kind: str, source: Path, arrays: Iterable[Any]) -> None:
    """Refuse a checkpoint holding NaN or inf: loaded into an adapter slot, it would poison the products
    of every adapter batched beside it (0 * NaN is NaN), and a training step would never make it finite."""
    if not all(_finite(x) for x in arrays):
        raise RequestError(
            f"{kind} {source.name!r} holds values that are not finite (NaN or inf); it cannot be loaded (an "
            "earlier version could save such weights after a diverged step): use an earlier checkpoint",
            "user",
        )


def _finite(x: Any) -> bool:
    if isinstance(x, jax.Array):  # reduced where it lives (a sharded weight is never gathered)
        return bool(to_host(jnp.isfinite(x).all()))
    return bool(np.isfinite(np.asarray(x)).all())


def scrub_paths(message: str, roots: Iterable[Path]) -> str:
    """`message` without absolute server paths: `<root>/rest` becomes `rest`, others their last part."""
    for root in sorted((str(Path(r).resolve()) for r in roots), key=len, reverse=True):
        message = message.replace(root + "/", "").replace(root, ".")
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1), message)


def as_request_error(err: BaseException, roots: Iterable[Path] = ()) -> RequestError:
    """The error a failed item reports (see the module docstring)."""
    if isinstance(err, RequestError):
        return RequestError(scrub_paths(err.message, roots), err.category)
    if out_of_space(err):
        return RequestError(DISK_FULL, "server")
    category: ErrorCategory = "user" if isinstance(err, USER_ERRORS) else "server"
    detail = str(err) if category == "user" else f"{type(err).__name__}: {err}"
    return RequestError(scrub_paths(detail, roots), category)
