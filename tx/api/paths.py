"""`tinker://` checkpoint paths and where their files live in the data directory.

A checkpoint path is `tinker://{run_id}/{weights|sampler_weights|external_weights}/{name}`; its REST id is the
last two parts (`weights/{name}`). Files live under `<data_dir>/checkpoints/<run>/<kind>/<name>`
with the run id's colons replaced so the layout is portable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tx.names import check_name, contained

SCHEME = "tinker://"
KIND_TO_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return KIND_TO_TYPE[self.kind]

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"


def parse_tinker_path(path: str) -> TinkerPath | None:
    """Parse a checkpoint path; None when it is not one of ours, `BadName` when its name breaks the rule."""
    if not path.startswith(SCHEME):
        return None
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in KIND_TO_TYPE or not parts[0] or not parts[2]:
        return None
    return TinkerPath(parts[0], parts[1], check_name(parts[2], "checkpoint name"))


def checkpoints_root(data_dir: Path) -> Path:
    return data_dir.resolve() / "checkpoints"


def checkpoint_dir(data_dir: Path, path: TinkerPath) -> Path:
    """The checkpoint's directory; `BadName` unless its name follows the rule and it stays inside the root."""
    check_name(path.name, "checkpoint name")
    root = checkpoints_root(data_dir)
    return contained(root / path.run_id.replace(":", "_") / path.kind / path.name, root)
