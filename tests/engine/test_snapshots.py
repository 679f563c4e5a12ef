"""Full fine-tuning snapshots held in host memory stay there until they are back on the device."""

import jax.numpy as jnp
import numpy as np
import pytest

from tx.engine.snapshots import FullSnapshots, HostWeights
from tx.lora.slots import SlotsExhausted


class _Sampler:
    def __init__(self) -> None:
        self.busy = False

    def idle(self) -> bool:
        return not self.busy


def test_a_held_snapshot_that_does_not_fit_back_stays_held(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
    weights = {("w",): jnp.arange(4.0)}
    snapshots.adopt({"snap": HostWeights.of(weights)})

    def no_room(self: HostWeights) -> dict:
        raise MemoryError("planted: the device is full")

    with monkeypatch.context() as patch:
        patch.setattr(HostWeights, "on_device", no_room)
        with pytest.raises(MemoryError):
            snapshots.use("snap")
    assert "snap" in snapshots and len(snapshots) == 1  # still held: the next use can bring it back
    assert snapshots.use("snap") is not None
    np.testing.assert_array_equal(np.asarray(snapshots.to_host()["snap"].arrays[("w",)]), np.arange(4.0))


def test_a_copy_beyond_the_kept_ones_waits_while_they_are_all_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kept snapshots, both being sampled: a third save (or a held one coming back) waits, as
    `SlotsExhausted`, instead of a third device copy and a third decode chunk per step; once one is idle it
    makes room for the new one. A held one that must wait is not copied to the device first (its sample
    retries every step: a whole weight set copied and dropped each time)."""
    copies = []
    monkeypatch.setattr(HostWeights, "on_device", lambda self: copies.append(self) or dict(self.arrays))
    snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
    weights = {("w",): jnp.zeros(2)}
    for sid in ("a", "b"):
        snapshots.add(sid, weights)
        snapshots.use(sid).busy = True  # type: ignore[union-attr]
    snapshots.adopt({"held": HostWeights.of(weights)})
    with pytest.raises(SlotsExhausted):
        snapshots.add("c", weights)
    with pytest.raises(SlotsExhausted):
        snapshots.use("held")
    assert "c" not in snapshots and "held" in snapshots and len(snapshots.samplers()) == 2 and copies == []
    snapshots.use("a").busy = False  # type: ignore[union-attr]
    snapshots.add("c", weights)
    assert "a" not in snapshots and "c" in snapshots and len(snapshots.samplers()) == 2


def test_a_snapshot_saved_again_while_being_sampled_keeps_its_old_copy_until_idle() -> None:
    """The old copy keeps serving the samples queued on it under a name no request uses; the name samples the
    new weights at once; the old copy is neither handed to host memory nor kept once idle."""
    snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
    snapshots.add("a", {("w",): jnp.zeros(2)})
    old = snapshots.use("a")
    old.busy = True  # type: ignore[union-attr]
    snapshots.add("a", {("w",): jnp.ones(2)})
    assert snapshots.use("a") is not old and old in snapshots.samplers() and len(snapshots.samplers()) == 2
    assert set(snapshots.to_host()) == {"a"}
    old.busy = False  # type: ignore[union-attr]
    snapshots.add("b", {("w",): jnp.zeros(2)})
    assert old not in snapshots.samplers() and len(snapshots.samplers()) == 2


def test_an_unloaded_model_hands_over_only_its_newest_kept_snapshots() -> None:
    """Each unload hands the next load the `max_kept` most recently used snapshots, held or on the device:
    a model that saved new snapshots between unloads held every older one too, a whole weight set each."""
    snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
    for cycle in range(3):
        for sid in (f"a{cycle}", f"b{cycle}"):
            snapshots.add(sid, {("w",): jnp.full(2, float(cycle))})
        held = snapshots.to_host()
        assert list(held) == [f"a{cycle}", f"b{cycle}"]
        snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
        snapshots.adopt(held)
    snapshots.use("a2")  # back on the device, now the most recent
    assert list(snapshots.to_host()) == ["b2", "a2"]
    np.testing.assert_array_equal(snapshots.to_host()["b2"].arrays[("w",)], np.full(2, 2.0))


def test_a_dropped_snapshot_is_gone_and_its_queued_copy_stays() -> None:
    """A save whose files failed drops its new copy: the name is sampled from its checkpoint again, and an
    older copy still serving queued samples keeps serving them."""
    snapshots = FullSnapshots(lambda get_weights: _Sampler(), max_kept=2)  # type: ignore[arg-type, return-value]
    snapshots.add("a", {("w",): jnp.zeros(2)})
    old = snapshots.use("a")
    old.busy = True  # type: ignore[union-attr]
    snapshots.add("a", {("w",): jnp.ones(2)})
    snapshots.drop("a")
    assert "a" not in snapshots and snapshots.use("a") is None and snapshots.samplers() == [old]
    snapshots.adopt({"h": HostWeights.of({("w",): jnp.ones(2)})})
    snapshots.drop("h")
    assert "h" not in snapshots and len(snapshots) == 1
