"""Training checkpoints on disk: a run's weights, optimizer state and step, written atomically.

Layout of a `save_state` directory: `run.json` (adapter shape, step, base model) and `state/`, an orbax
checkpoint of {"params", "opt_state"}. The directory is written under a temporary name and renamed into
place once `run.json`, written last, is there, so a crash mid-save never leaves a directory that looks like
a whole checkpoint, nor touches the checkpoint it replaces. Over several processes (`tx.engine.multihost`)
orbax writes each process's shards into the one shared directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tx.engine.errors import check_finite, damaged_checkpoint
from tx.gather import barrier, is_writer
from tx.protocol import LoraConfig

META = "run.json"


def _keyed(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    return {"/".join(p): v for p, v in flat.items()}


def _unkeyed(named: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    return {tuple(k.split("/")): v for k, v in named.items()}


def save(dest: Path, params: dict, opt_state: Any, step: int, lora: LoraConfig | None, base_model: str) -> int:
    """Write the checkpoint; returns its size in bytes. It is written beside `dest` under a name no user
    name can take (`.NAME.tmp-state`) and renamed into place once whole, so a save that fails or is killed
    half-way leaves the checkpoint it replaces as it was. Over several processes every one calls this
    (orbax writes each process's shards) into a directory they all reach; process 0 alone clears what a
    killed save left, writes `run.json` last and renames (0 bytes is returned elsewhere)."""
    tmp = dest.parent / f".{dest.name}.tmp-state"
    if is_writer():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(f"checkpoint cleared: {dest}")
    try:
        size = _write(tmp, params, opt_state, step, lora, base_model)
        if is_writer():
            _replace(tmp, dest)
        return size
    except BaseException:
        if is_writer():  # a checkpoint that failed half-way (a full disk) leaves no partial files behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(new: Path, dest: Path) -> None:
    """Put the whole checkpoint `new` at `dest`, the old one moved aside first and removed after."""
    old = dest.parent / f".{dest.name}.old-state"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old, ignore_errors=True)


def _write(dest: Path, params: dict, opt_state: Any, step: int, lora: LoraConfig | None, base_model: str) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    tree = {"params": _keyed(params), "opt_state": opt_state}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dest / "state", tree, force=True)
    if not is_writer():
        return 0
    meta = {"step": step, "base_model": base_model, "lora": dataclasses.asdict(lora) if lora else None}
    tmp = dest / f".{META}.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, dest / META)
    return sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())


def read_meta(source: Path) -> tuple[LoraConfig | None, int]:
    if not (source / META).is_file():
        raise FileNotFoundError(f"{source} is not a complete SmolGym training checkpoint (no {META})")
    try:
        meta = json.loads((source / META).read_text())
        lora = LoraConfig(**meta["lora"]) if meta.get("lora") else None
        if lora is not None and not (isinstance(lora.rank, int) and lora.rank > 0):
            raise ValueError(f"rank {lora.rank!r}")
        return lora, int(meta.get("step", 0))
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise damaged_checkpoint("checkpoint", source, META, exc) from exc


def restore(source: Path, params_like: dict, opt_like: Any) -> tuple[dict, Any]:
    """Restore into the structure (and shardings) of an existing run's params and optimizer state."""
    target = {"params": _keyed(params_like), "opt_state": opt_like}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(source / "state", abstract)
    except Exception as exc:  # tensorstore and orbax name missing or truncated files in many ways
        raise damaged_checkpoint("checkpoint", source, "state/", exc) from exc
    check_finite("checkpoint", source, jax.tree.leaves(tree))
    return _unkeyed(tree["params"]), tree["opt_state"]


def mark_saved(dest: Path, future_id: str) -> None:
    """Record, beside a checkpoint whose files are in place, the save that wrote them (`.NAME.saved-by`, one
    per name, replaced by each save): killed before the engine recorded the save, a restart put the replaced
    checkpoint's row back over the new files. The restart reads it (`saved_by`), then the sweep removes it."""
    marker = dest.with_name(f".{dest.name}.saved-by")
    tmp = dest.with_name(f".{dest.name}.saved-by.tmp")
    tmp.write_text(future_id)
    os.replace(tmp, marker)


def saved_by(dest: Path, future_id: str) -> bool:
    """Whether the save `future_id` left its files in place at `dest` (`mark_saved`)."""
    try:
        return dest.is_dir() and dest.with_name(f".{dest.name}.saved-by").read_text() == future_id
    except OSError:
        return False


PARTIAL_MARKERS = (".tmp-", ".old-", "orbax-checkpoint-tmp", f".{META}.tmp")


def sweep_partial(root: Path) -> list[Path]:
    """Remove what writers killed mid-write left under the checkpoint root (`<run>/<kind>/<name>`): the
    temporary and moved-aside directories of the atomic writers, orbax's temporary directories, and
    `save_state` directories that never got their `run.json`. A finished checkpoint is never touched, and
    one a save had moved aside when it was killed goes back to its name. Save markers go too, uncounted."""
    removed: list[Path] = []
    for entry in sorted(root.glob("*/*/*")) if root.is_dir() else []:
        if _put_back(entry):
            continue
        if _is_marker(entry):  # a finished save's marker (`mark_saved`), read by now: no half-write
            entry.unlink(missing_ok=True)
            continue
        # user names never start with "." (`tx.names`), and every writer's temporary does (`save_hf`'s too); a
        # user may name a checkpoint `step.tmp-1`, so the markers count only inside a checkpoint's directory
        partial = entry.name.startswith(".")
        unfinished = entry.parent.name == "weights" and entry.is_dir() and not (entry / META).is_file()
        inner = [p for p in entry.glob("*") if any(m in p.name for m in PARTIAL_MARKERS)] if entry.is_dir() else []
        for path in [entry] if partial or unfinished else inner:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _is_marker(entry: Path) -> bool:
    """`.NAME.saved-by` (or its temporary): dot-named, so no user's checkpoint (`epoch.saved-by-x` is one)."""
    return entry.name.startswith(".") and entry.name.endswith((".saved-by", ".saved-by.tmp")) and entry.is_file()


def _put_back(entry: Path) -> bool:
    """A checkpoint a writer moved aside and was killed before the new one took its name: `save`'s
    `.NAME.old-state` (`_replace`), or `atomic_dir`'s `.NAME.old-XXXX/NAME` (PEFT, HF directories)."""
    if not entry.name.startswith(".") or not entry.is_dir():
        return False
    if entry.name.endswith(".old-state"):
        moved, original = entry, entry.with_name(entry.name[1 : -len(".old-state")])
        if not (moved / META).is_file():
            return False
    elif ".old-" in entry.name:
        name = entry.name[1:].rsplit(".old-", 1)[0]
        moved, original = entry / name, entry.with_name(name)
    else:
        return False
    if original.exists() or not moved.is_dir():
        return False
    os.rename(moved, original)
    if moved is not entry:
        shutil.rmtree(entry, ignore_errors=True)  # atomic_dir's wrapper, empty now
    return True
