"""Full fine-tuning snapshots held in host memory stay there until they are back on the device."""

import jax.numpy as jnp
import numpy as np
import pytest

from tx.engine.snapshots import FullSnapshots, HostWeights


class _Sampler:
    def idle(self) -> bool:
        return True


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
