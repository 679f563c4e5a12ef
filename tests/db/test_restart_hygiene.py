"""What a crashed server leaves behind is cleaned at the next start; nothing finished is touched."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

from tx.db import open_database
from tx.engine.checkpoints import sweep_partial


def _make(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_sweep_removes_partial_directories_only(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    run = root / "s1_train_0"
    finished = _make(run / "weights" / "done", {"run.json": "{}"})
    peft = _make(run / "sampler_weights" / "snap", {"adapter_config.json": "{}"})
    partial = [
        _make(run / "weights" / "half", {"junk": ""}),  # a save_state that never wrote run.json
        _make(run / "sampler_weights" / ".snap.tmp-x1", {"a": ""}),
        _make(run / "sampler_weights" / ".snap.old-y2", {"a": ""}),
        _make(run / "external_weights" / ".exp.tmp-0f", {}),
        _make(run / "sampler_weights" / ".full.tmp", {"model.safetensors": ""}),  # an older full save's temp
        _make(finished / "state.orbax-checkpoint-tmp-123", {"x": ""}),
    ]
    (finished / ".run.json.tmp").write_text("{")
    removed = sweep_partial(root)
    assert finished.is_dir() and (finished / "run.json").is_file() and peft.is_dir()
    assert not any(p.exists() for p in partial) and not (finished / ".run.json.tmp").exists()
    assert set(removed) == {*partial, finished / ".run.json.tmp"}
    assert sweep_partial(root) == [] and sweep_partial(tmp_path / "missing") == []


def test_sweep_removes_save_markers_without_counting_them_as_half_written(tmp_path: Path) -> None:
    """`.NAME.saved-by` beside a finished checkpoint is read by the restart before the sweep; every restart
    after a named save warned of half-written directories it had "removed" when it removed these."""
    run = tmp_path / "checkpoints" / "s1_train_0"
    done = _make(run / "weights" / "done", {"run.json": "{}"})
    (run / "weights" / ".done.saved-by").write_text("42")
    (run / "weights" / ".done.saved-by.tmp").write_text("4")
    named = _make(run / "sampler_weights" / "epoch1.saved-by-alice", {"adapter_config.json": "{}"})  # a user's
    assert sweep_partial(tmp_path / "checkpoints") == []
    assert [p.name for p in (run / "weights").iterdir()] == ["done"] and (done / "run.json").is_file()
    assert (named / "adapter_config.json").is_file()


def test_sweep_keeps_finished_checkpoints_whose_names_look_like_temporaries(tmp_path: Path) -> None:
    """`step.tmp-1`, `v2.old-best` and `orbax-checkpoint-tmp-x` are valid checkpoint names: every restart
    removed such finished checkpoints (listed still, their files gone). Writers' temporaries start with '.'."""
    run = tmp_path / "checkpoints" / "s1_train_0"
    kept = [
        _make(run / "weights" / "step.tmp-1", {"run.json": "{}"}),
        _make(run / "weights" / "orbax-checkpoint-tmp-x", {"run.json": "{}"}),
        _make(run / "sampler_weights" / "v2.old-best", {"adapter_config.json": "{}"}),
        _make(run / "sampler_weights" / "run.json.tmp", {"adapter_config.json": "{}"}),
    ]
    assert sweep_partial(tmp_path / "checkpoints") == []
    assert all(p.is_dir() and any(p.iterdir()) for p in kept)


def test_sweep_puts_back_a_checkpoint_a_killed_save_had_moved_aside(tmp_path: Path) -> None:
    """A save_state killed between moving the old checkpoint aside and renaming the new one in: the old one
    goes back to its name and the new one's temporary is removed; one whose name is taken again stays aside."""
    weights = tmp_path / "checkpoints" / "s1_train_0" / "weights"
    _make(weights / ".latest.old-state", {"run.json": '{"step": 3}'})
    _make(weights / ".latest.tmp-state", {"run.json": '{"step": 4}'})
    _make(weights / ".kept.old-state", {"run.json": "{}"})
    _make(weights / "kept", {"run.json": "{}"})
    removed = sweep_partial(tmp_path / "checkpoints")
    assert (weights / "latest" / "run.json").read_text() == '{"step": 3}'
    assert set(removed) == {weights / ".latest.tmp-state", weights / ".kept.old-state"}
    assert sorted(p.name for p in weights.iterdir()) == ["kept", "latest"]


def test_sweep_puts_back_a_sampler_checkpoint_a_killed_write_had_moved_aside(tmp_path: Path) -> None:
    """`atomic_dir` (PEFT adapters, HF directories) moves the old directory into `.NAME.old-XXXX/NAME` before
    renaming the new one in; killed between the two renames, both were swept as partial and the name's
    restored row had no files. The old one goes back; the new one's temporary goes."""
    sampler = tmp_path / "checkpoints" / "s1_train_0" / "sampler_weights"
    _make(sampler / ".x.old-9f" / "x", {"adapter_config.json": '{"r": 4}'})
    _make(sampler / ".x.tmp-3a", {"adapter_config.json": '{"r": 8}'})
    _make(sampler / ".y.old-1b" / "y", {"adapter_config.json": "{}"})
    _make(sampler / "y", {"adapter_config.json": '{"r": 2}'})  # taken again: the moved-aside one goes
    removed = sweep_partial(tmp_path / "checkpoints")
    assert (sampler / "x" / "adapter_config.json").read_text() == '{"r": 4}'
    assert (sampler / "y" / "adapter_config.json").read_text() == '{"r": 2}'
    assert sorted(p.name for p in sampler.iterdir()) == ["x", "y"]
    assert set(removed) == {sampler / ".x.tmp-3a", sampler / ".y.old-1b"}


def test_old_databases_take_nan_metrics(tmp_path: Path) -> None:
    """A database made when metrics.value was NOT NULL is migrated at open, and its rows kept."""
    db = open_database(None, tmp_path)
    db.close()
    path = tmp_path / "smolgym.db"
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE metrics")
        conn.execute(
            "CREATE TABLE metrics (id INTEGER PRIMARY KEY, model_id VARCHAR NOT NULL, future_id VARCHAR NOT NULL,"
            " kind VARCHAR NOT NULL, name VARCHAR NOT NULL, value FLOAT NOT NULL, created_at DATETIME NOT NULL)"
        )
        conn.execute("INSERT INTO metrics VALUES (1, 'm', 'f', 'optim_step', 'a:mean', 2.5, '2026-01-01 00:00:00')")
    db = open_database(None, tmp_path)
    try:
        from sqlmodel import Session

        from tx.db.tables import MetricRow

        with Session(db.engine) as session:
            session.add(MetricRow(model_id="m", future_id="g", kind="optim_step", name="b:mean", value=None))
            session.commit()
        values = {m.name: m.value for m in db.records.latest_metrics("m")}
        assert values["a:mean"] == 2.5 and math.isnan(values["b:mean"])
    finally:
        db.close()


def test_a_full_weight_save_that_fails_leaves_nothing(tmp_path: Path, monkeypatch, hf_models) -> None:  # type: ignore[no-untyped-def]
    """`save_hf` writing a full model directory runs out of disk in the tensors file: no partial directory
    stays beside the destination, and a directory saved there before is kept whole."""
    import errno

    import jax.numpy as jnp
    import safetensors.numpy

    from tx.models import weights
    from tx.models.config import load_hf_config

    source, _ = hf_models()
    dest = _make(tmp_path / "run" / "sampler_weights" / "s", {"model.safetensors": "old"})
    cfg = load_hf_config(source)

    def full_disk(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    try:
        weights.save_hf({("model", "embed_tokens", "embedding"): jnp.zeros((8, 4))}, cfg, source, dest)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    else:
        raise AssertionError("the full disk went unnoticed")
    assert [p.name for p in dest.parent.iterdir()] == ["s"] and (dest / "model.safetensors").read_text() == "old"


def test_a_save_killed_after_its_files_were_in_place_is_done_after_the_restart(tmp_path: Path) -> None:
    """A save over a taken name, killed after renaming its new files into place but before the engine recorded
    it: the restart failed it and put the replaced checkpoint's row back, over the new files (a load of that
    path read weights its row said were never saved). The engine marks a save's files in place; the restart
    finishes such a save as done and drops the old row. A save killed before that still fails, its old row
    back."""
    from tx.api.__main__ import recover
    from tx.db.tables import CheckpointRow
    from tx.engine.checkpoints import mark_saved
    from tx.protocol import SaveStateRequest

    db = open_database(None, tmp_path)
    weights = tmp_path / "checkpoints" / "s1_train_0" / "weights"
    futures = {}
    for name in ("landed", "killed"):
        path = f"tinker://s1:train:0/weights/{name}"
        old = CheckpointRow(run_id="s1:train:0", checkpoint_id=f"weights/{name}", checkpoint_type="training",
                            tinker_path=path, owner="o", directory=str(weights / name), status="ready")  # fmt: skip
        db.records.add_rows([old])
        db.records.set_aside(db.records.get_checkpoint("s1:train:0", f"weights/{name}", "o"))  # type: ignore[arg-type]
        new = CheckpointRow(run_id="s1:train:0", checkpoint_id=f"weights/{name}", checkpoint_type="training",
                            tinker_path=path, owner="o", directory=str(weights / name))  # fmt: skip
        payload = SaveStateRequest(name, str(weights / name), path)
        futures[name] = db.queue.submit(kind="save_state", payload=payload, owner="o", model_id="s1:train:0",
                                        rows=[new]).future_id  # fmt: skip
        _make(weights / name, {"run.json": '{"step": 2}'})
    db.queue.claim(10)
    mark_saved(weights / "landed", futures["landed"])
    recover(db, tmp_path)
    landed, killed = (db.queue.get(futures[name]) for name in ("landed", "killed"))
    assert landed is not None and landed.status == "done" and killed is not None and killed.status == "failed"
    for name, want in (("landed", futures["landed"]), ("killed", None)):
        row = db.records.get_checkpoint("s1:train:0", f"weights/{name}", "o")
        assert row is not None and row.future_id == want, (name, row)  # the new row, or the old one back
    assert not [p for p in weights.iterdir() if p.name.startswith(".")]  # the sweep took the marker
