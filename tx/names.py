"""The one naming rule for user-supplied names that become paths, and the check that a path stays inside.

Checkpoint, sampler and export names end up as one directory component under the data directory, so
they are checked twice: by the API before a request is queued (a 400 naming the field and this rule)
and by the engine where the name becomes a path (`contained`, which resolves the path and refuses one
that leaves its root). The rule: 1 to `MAX_NAME_LEN` characters of letters, digits, `_`, `-` and `.`,
not starting with `.` (so never `.` or `..`, and never a hidden temp-file name of our own writers).
Leaf module: imports nothing from `tx`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_NAME_LEN = 128
NAME_RULE = f"1-{MAX_NAME_LEN} characters of letters, digits, '_', '-' and '.', not starting with '.'"
_NAME = re.compile(rf"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{{0,{MAX_NAME_LEN - 1}}}")


class BadName(ValueError):
    """A user-supplied name or path that breaks the naming rule or leaves its root directory."""


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: object, field: str) -> str:
    """`name` if it follows the rule; otherwise `BadName` naming `field` and the rule."""
    if not is_valid_name(name):
        shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:37] + "..."
        raise BadName(f"{field} {shown} is not a valid name: use {NAME_RULE}")
    assert isinstance(name, str)
    return name


def contained(path: str | Path, root: str | Path) -> Path:
    """`path` resolved, if its last part (as given, and once resolved) follows the rule and it lies strictly
    inside `root` (resolved)."""
    check_name(os.path.basename(os.fspath(path)), "checkpoint name")  # pathlib would drop a trailing "."
    root_resolved = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved == root_resolved or not resolved.is_relative_to(root_resolved):
        raise BadName(f"checkpoint location {Path(path).name!r} is outside the checkpoint directory")
    check_name(resolved.name, "checkpoint name")
    return resolved
