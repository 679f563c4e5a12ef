"""benchmarks/mutation.py's mutator: which mutants a source gets, and that each changes exactly one thing."""

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("benchmarks_mutation", ROOT / "benchmarks" / "mutation.py")
assert spec is not None and spec.loader is not None
mutation = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mutation
spec.loader.exec_module(mutation)

SOURCE = '''
"""Docstring with 1 < 2 is left alone."""
import logging

log = logging.getLogger("x")


def f(a: int, b: float = 0.5) -> bool:
    """Nor is this one."""
    log.info("value %d", a + 1)
    if not a and -b < 2:
        return a * b >= 3
    return f"{a + 1}" == "2"
'''


def test_mutants_cover_operators_and_constants_but_not_docs_logs_or_fstrings() -> None:
    found = [(line, desc) for _, desc, line in mutation.mutation_points(ast.parse(SOURCE))]
    assert sorted(found) == sorted(
        [
            (8, "0.5 -> 1.5"),
            (11, "And -> Or"),
            (11, "drop Not"),
            (11, "0:Lt -> LtE"),
            (11, "drop USub"),
            (11, "2 -> 3"),
            (12, "Mult -> Div"),
            (12, "0:GtE -> Gt"),
            (12, "3 -> 4"),
            (13, "0:Eq -> NotEq"),
        ]
    )


def test_each_mutant_changes_one_node_and_parses() -> None:
    original = ast.dump(ast.parse(SOURCE))
    count = len(mutation.mutation_points(ast.parse(SOURCE)))
    mutated = {mutation.mutate(SOURCE, i)[0] for i in range(count)}
    assert len(mutated) == count  # all different from each other
    for source in mutated:
        assert ast.dump(ast.parse(source)) != original
    assert (
        "return a * b > 3"
        in mutation.mutate(
            SOURCE,
            next(i for i, (_, d, _) in enumerate(mutation.mutation_points(ast.parse(SOURCE))) if d == "0:GtE -> Gt"),
        )[0]
    )


def test_a_mutant_runs_the_tests_that_execute_its_statement_or_all_after_an_import_time_line() -> None:
    source = "X = 1\n\n\ndef g(a):\n    if a > 2:\n        return max(\n            a,\n            3,\n        )\n"
    source += "    return 0\n"
    tree = ast.parse(source)
    spans = mutation.statement_lines(tree)
    lines = {desc: spans[id(node)] for node, desc, _ in mutation.mutation_points(tree)}
    assert lines["0:Gt -> GtE"] == range(5, 6)  # the `if` header, not its body
    assert lines["3 -> 4"] == range(6, 10)  # the whole `return max(...)` statement
    by_line = {1: {""}, 5: {"t.py::a", "t.py::b"}, 8: {"t.py::b"}}
    assert mutation.tests_for(lines["3 -> 4"], by_line) == {"t.py::b"}
    assert mutation.tests_for(lines["0:Gt -> GtE"], by_line) == {"t.py::a", "t.py::b"}
    assert mutation.tests_for(lines["1 -> 2"], by_line) is None  # ran at import: every test
    assert mutation.tests_for(lines["0 -> 1"], by_line) == set()  # no test reaches it


def test_picks_are_all_an_even_spread_or_a_seeded_sample() -> None:
    assert mutation.pick(5, None, None) == [0, 1, 2, 3, 4] == mutation.pick(5, 9, 1)
    assert mutation.pick(9, 3, None) == [0, 4, 8]
    sample = mutation.pick(100, 10, 7)
    assert sample == mutation.pick(100, 10, 7) == sorted(set(sample)) and len(sample) == 10
    assert sample != mutation.pick(100, 10, 8)


def test_an_axis_counted_from_the_end_moves_but_keeps_its_sign() -> None:
    source = "def f(x, y):\n    return x.sum(axis=-1) + y[-1] + x.shape[-2] - g(-3)\n"
    found = sorted(desc for _, desc, _ in mutation.mutation_points(ast.parse(source)))
    # axis=-1 and .shape[-2] only move; the index y[-1] and the argument -3 also lose their sign
    assert found == sorted(["1 -> 2", "1 -> 2", "2 -> 3", "3 -> 4", "drop USub", "drop USub", "Add -> Sub",
                            "Add -> Sub", "Sub -> Add"])  # fmt: skip


def test_a_subset_that_fails_without_a_mutant_is_not_trusted(tmp_path: Path) -> None:
    """Two test files that pass alone and fail together (the second checks state the first leaves in the process):
    a mutant run on that pair would count as killed, so the pair is found unsound once and remembered."""
    (tmp_path / "test_first.py").write_text("import os\n\n\ndef test_sets():\n    os.environ['LEFT_BEHIND'] = '1'\n")
    (tmp_path / "test_second.py").write_text(
        "import os\n\n\ndef test_reads():\n    assert 'LEFT_BEHIND' not in os.environ\n"
    )
    sound: dict[frozenset[str], bool] = {}
    restored: list[int] = []
    both, second = {"test_first.py", "test_second.py"}, {"test_second.py"}
    assert not mutation._subset_passes(both, sound, lambda: restored.append(1), tmp_path, [], 60)
    assert mutation._subset_passes(second, sound, lambda: restored.append(1), tmp_path, [], 60)
    assert mutation._subset_passes(second, sound, lambda: restored.append(1), tmp_path, [], 60)  # remembered
    assert sound == {frozenset(both): False, frozenset(second): True} and len(restored) == 2
