"""The full fine-tuning memory check reads the accelerators' own free memory, the host's only on CPU."""

import psutil

from tx.engine.weights_io import free_bytes


class FakeDevice:
    def __init__(self, stats: dict | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict | None:
        return self.stats


def test_accelerator_memory_is_what_its_allocator_reports():
    gpus = {FakeDevice({"bytes_limit": 100 << 30, "bytes_in_use": 30 << 30}), FakeDevice({"bytes_limit": 10 << 30})}
    assert free_bytes(gpus) == (70 << 30) + (10 << 30)  # type: ignore[arg-type]


def test_devices_without_stats_fall_back_to_host_memory():
    host = psutil.virtual_memory().available
    assert abs(free_bytes({FakeDevice(None)}) - host) < 1 << 30  # type: ignore[arg-type]
