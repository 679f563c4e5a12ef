"""The naming rule for user names that become paths, containment on real directories, and `tinker://` paths.

Host code only: each check here is what stands between a request's string and a path outside the data
directory, so each edge of the rule (length, first character, the message's shape) is asserted on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tx.api.paths import TinkerPath, checkpoint_dir, checkpoints_root, parse_tinker_path
from tx.names import MAX_NAME_LEN, BadName, check_name, contained, is_valid_name


@pytest.mark.parametrize("name", ["a", "step-10", "A_b.c-9", "9", "_x", "-x", "x.", "x" * MAX_NAME_LEN])
def test_names_inside_the_rule(name: str) -> None:
    assert is_valid_name(name)
    assert check_name(name, "path") == name


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", ".hidden", "a/b", "a\\b", "a b", "a\x00", "é", "x" * (MAX_NAME_LEN + 1), None, 7, b"abc"],
)
def test_names_outside_the_rule(name: object) -> None:
    assert not is_valid_name(name)
    with pytest.raises(BadName, match="^path .* is not a valid name: use 1-128 characters"):
        check_name(name, "path")


def test_the_limit_is_128() -> None:
    assert MAX_NAME_LEN == 128


def test_a_long_name_is_shown_cut_to_forty_characters() -> None:
    short = "a/" + "b" * 36  # repr is 40 characters: shown whole
    assert len(repr(short)) == 40
    with pytest.raises(BadName) as err:
        check_name(short, "name")
    assert f"name {short!r} is not" in str(err.value)
    longer = short + "c"  # 41: cut to 37 characters and "..."
    with pytest.raises(BadName) as err:
        check_name(longer, "name")
    assert f"name {repr(longer)[:37]}... is not" in str(err.value)


def test_contained_resolves_a_path_inside_its_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run" / "weights").mkdir(parents=True)
    got = contained(root / "run" / "weights" / "step-1", root)
    assert got == (root / "run" / "weights" / "step-1").resolve()
    assert contained(str(root / "direct"), str(root)) == (root / "direct").resolve()


def test_contained_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (root / "to-outside").symlink_to(tmp_path / "outside")
    (root / "to-root").symlink_to(root)
    (root / "to-hidden").symlink_to(root / ".hidden")
    for escape in [root / ".." / "outside", root / "to-outside" / "x", root / "to-outside", root / "to-root"]:
        with pytest.raises(BadName, match="outside the checkpoint directory"):
            contained(escape, root)
    for bad_last in [root / "to-hidden", f"{root}/x/.", f"{root}/x/..", Path(f"{root}/x/..")]:
        with pytest.raises(BadName, match="is not a valid name"):
            contained(bad_last, root)


def test_parse_tinker_path() -> None:
    path = parse_tinker_path("tinker://run:1/weights/step-1")
    assert path == TinkerPath("run:1", "weights", "step-1")
    assert path.checkpoint_id == "weights/step-1" and path.checkpoint_type == "training"
    assert str(path) == "tinker://run:1/weights/step-1"
    assert {path, TinkerPath("run:1", "weights", "step-1")} == {path}  # a value: hashable, equal by fields
    with pytest.raises(AttributeError):
        path.name = ".."  # type: ignore[misc]
    sampler = parse_tinker_path("tinker://r/sampler_weights/s")
    assert sampler is not None and sampler.checkpoint_type == "sampler"
    external = parse_tinker_path("tinker://r/external_weights/e")
    assert external is not None and external.checkpoint_type == "external"


@pytest.mark.parametrize(
    "text",
    [
        "http://r/weights/a",
        "r/weights/a",
        "tinker://r/weights",
        "tinker://r/weights/a/b",
        "tinker://r/optimizer/a",
        "tinker:///weights/a",
        "tinker://r/weights/",
    ],
)
def test_not_our_paths(text: str) -> None:
    assert parse_tinker_path(text) is None


@pytest.mark.parametrize("text", ["tinker://r/weights/..", "tinker://r/weights/.x", "tinker://r/weights/a b"])
def test_our_paths_with_a_bad_name(text: str) -> None:
    with pytest.raises(BadName, match="checkpoint name"):
        parse_tinker_path(text)


def test_checkpoint_dir(tmp_path: Path) -> None:
    assert checkpoints_root(tmp_path) == tmp_path.resolve() / "checkpoints"
    got = checkpoint_dir(tmp_path, TinkerPath("run:1", "sampler_weights", "s-2"))
    assert got == tmp_path.resolve() / "checkpoints" / "run_1" / "sampler_weights" / "s-2"
    for run_id, name in [("..", "x"), ("../..", "x"), ("r", "..")]:
        with pytest.raises(BadName):
            checkpoint_dir(tmp_path, TinkerPath(run_id, "weights", name))
