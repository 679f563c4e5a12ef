"""A fixed adapter scale table as the sampler reads a bank (`tx.engine.sampler.AdapterView`), for sampler tests
whose weights are a plain state rather than a trainer's bank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import numpy as np

from tx.lora.params import AdapterRoles


@dataclasses.dataclass
class FixedAdapters:
    get_scale: Callable[[], np.ndarray]  # read at every call, so a test may swap the table
    version: Callable[[], Hashable] | None = None  # None: unversioned (no prompt reuse across admissions)
    roles: AdapterRoles = dataclasses.field(kw_only=True)  # the weights' LoRA factors, by variable type

    @property
    def scale(self) -> np.ndarray:
        return self.get_scale()

    def weights_version(self) -> Hashable:
        return None if self.version is None else self.version()
