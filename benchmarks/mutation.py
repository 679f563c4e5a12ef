"""Mutation testing: plant one small bug at a time in a module, run that module's tests, count the kills.

A mutant changes one operator or constant (`<` -> `<=`, `+` -> `-`, `and` -> `or`, `not x` -> `x`,
`-x` -> `x`, `3` -> `4`, `0.5` -> `1.5`, `True` -> `False`) outside docstrings, f-strings, log calls and
annotations; an axis counted from the end (`axis=-1`, `.shape[-1]`) keeps its sign (`axis=1` is the same
axis of a two-dimensional array) and only moves (`-1` -> `-2`). Each runs in a scratch copy of the
repository (the checkout is never written), as a fresh `pytest -x`; it is killed when the tests fail or
time out. With `coverage` installed, one measured run of the module's tests first maps each line to the
tests whose call executes it: a mutant runs those tests first and all of them only if those pass (a
program compiled by one test may be what another asserts on; a subset that fails together without any
mutant, by test order, is found once and its mutants run every test instead), and a mutant on a line no test executes is
a survivor without a run (`"executed": false`). Prints one JSON line per module: mutants, killed, score
and the survivors (line, change) to kill with a test or explain as equivalent. Too slow for CI on 2
cores; run it before resolving an issue that touches these modules:
    python benchmarks/mutation.py --modules tx/api/validate.py
    python benchmarks/mutation.py --modules tx/engine/losses.py --max-mutants 40   # an even sample
    python benchmarks/mutation.py --modules tx/engine/sampling.py --max-mutants 30 --seed 1 --time-limit 900
    python benchmarks/mutation.py --modules tx/db/queue.py --json-dir out   # then, after new tests:
    python benchmarks/mutation.py --modules tx/db/queue.py --survivors out  # only what survived
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

try:
    import coverage
except ImportError:  # then every mutant runs every test
    coverage = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
# The modules where a silent bug costs users most, each with the tests that guard it.
TARGETS: dict[str, list[str]] = {
    "tx/engine/train_step.py": [
        "tests/engine/test_train_step.py",
        "tests/engine/test_target_logprobs.py",
        "tests/engine/test_optim_reference.py",
        "tests/engine/test_trainer.py",
        "tests/lora/test_slots.py",  # the bank's one-program slot clear (clear_slot_params)
    ],
    "tx/engine/losses.py": ["tests/engine/test_losses.py"],
    "tx/engine/sampling.py": ["tests/engine/test_sampling.py"],
    "tx/engine/weights_io.py": [
        "tests/engine/test_weights_io.py",
        "tests/engine/test_moe_serving.py",  # Qwen3.5-MoE's fused-experts export, loaded in peft and read back
        "tests/e2e/test_peft_export.py",
        "tests/e2e/test_full_finetune.py",
    ],
    "tx/lora/peft.py": ["tests/lora/test_peft.py"],
    # An adapter slot's PEFT reads and writes (what weights_io did before AdapterBank took them over).
    "tx/lora/adapters.py": [
        "tests/lora/test_slots.py",
        "tests/lora/test_multi_adapter.py",
        "tests/engine/test_moe_serving.py",  # a fused-experts export read back into another slot
        "tests/e2e/test_peft_export.py",
    ],
    "tx/engine/planner.py": ["tests/engine/test_planner.py"],
    "tx/engine/batching.py": ["tests/engine/test_batching.py", "tests/engine/test_trainer.py"],
    "tx/engine/sampler_rows.py": [
        "tests/engine/test_sampler_rows.py",
        "tests/engine/test_sampler.py",
        "tests/engine/test_prompt_cache.py",
    ],
    "tx/db/queue.py": ["tests/db/test_db_queue.py", "tests/db/test_db_engine_loop.py"],
    "tx/api/validate.py": ["tests/api/test_validate_rules.py", "tests/api/test_api_validation.py"],
    "tx/api/wire_decode.py": [
        "tests/api/test_wire_decode.py",
        "tests/api/test_api_wire.py",  # bodies encoded by the SDK's own converters
        "tests/api/test_wire_fuzz.py",
    ],
    "tx/engine/prompt_cache.py": ["tests/engine/test_prompt_cache.py"],
    "tx/engine/paging.py": ["tests/engine/test_paging.py", "tests/engine/test_ranks.py"],
    "tx/lora/slots.py": ["tests/lora/test_slots.py"],
    "tx/upload_store.py": ["tests/test_upload_store.py"],
    "tx/loss_spec.py": ["tests/api/test_validate_rules.py", "tests/engine/test_losses.py"],
    # The naming rule and containment: what keeps a request's string from becoming a path outside the data dir.
    "tx/names.py": ["tests/test_names.py"],
    "tx/api/paths.py": ["tests/test_names.py"],
    # Every accepted request and every result is stored through this codec: a wrong byte is a wrong answer.
    "tx/db/codec.py": ["tests/db/test_db_codec.py", "tests/db/test_db_queue.py"],
    "tx/api/wire_encode.py": ["tests/api/test_api_wire.py", "tests/api/test_wire_encode.py"],
    # Every metadata read is scoped to its owner here: a slip shows one key's runs to another.
    "tx/db/records.py": ["tests/db/test_records.py", "tests/db/test_db_queue.py", "tests/db/test_restart_hygiene.py"],
    # The memory a request or a run may take before it is refused (a silent slip: the kernel ends the server).
    "tx/engine/run_memory.py": ["tests/engine/test_run_memory.py", "tests/engine/test_paging.py"],
    "tx/engine/cache_budget.py": ["tests/engine/test_cache_budget.py"],
    "tx/engine/memory_guard.py": ["tests/engine/test_memory_guard.py"],
}
SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Pow: ast.Mult, ast.And: ast.Or, ast.Or: ast.And,
}  # fmt: skip
PLUGIN = "smolgym_mutation_contexts"  # this file, loaded into the coverage run as a pytest plugin
SKIP_CALLS = {"debug", "info", "warning", "error", "exception"}  # log.<level>(...) arguments


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes no mutant touches: docstrings, f-strings, annotations, log-call arguments."""
    out: set[int] = set()
    for node in ast.walk(tree):
        parts: list[ast.AST] = []
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                parts.append(body[0])
        if isinstance(node, ast.JoinedStr):
            parts.append(node)
        if isinstance(node, ast.AnnAssign | ast.arg) and node.annotation is not None:
            parts.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            parts.append(node.returns)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SKIP_CALLS:
            parts.extend(node.args)
        out.update(id(sub) for part in parts for sub in ast.walk(part))
    return out


AXIS_KEYWORDS = {"axis", "axes", "dim", "dimension"}


def _axis_signs(tree: ast.Module) -> set[int]:
    """ids of `-n` literals that index an axis from the end (`axis=-1`, `.shape[-1]`): flipping their sign names
    the same axis of the two-dimensional arrays most such code holds, so only their `-n -> -(n+1)` mutant runs."""
    out: set[int] = set()
    for node in ast.walk(tree):
        values: list[ast.AST] = []
        if isinstance(node, ast.Call):
            values = [kw.value for kw in node.keywords if kw.arg in AXIS_KEYWORDS]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            values = [node.slice]
        for value in values:
            if (
                isinstance(value, ast.UnaryOp)
                and isinstance(value.op, ast.USub)
                and isinstance(value.operand, ast.Constant)
            ):
                out.add(id(value))
    return out


def mutation_points(tree: ast.Module) -> list[tuple[ast.AST, str, int]]:
    """(node, description, line) for every mutant of `tree`, in a fixed order."""
    skip, axis_signs, points = _skipped(tree), _axis_signs(tree), []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.BinOp | ast.BoolOp) and type(node.op) in SWAPS:
            points.append((node, f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}", line))
        elif isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in SWAPS:
                    points.append((node, f"{i}:{type(op).__name__} -> {SWAPS[type(op)].__name__}", line))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub) and id(node) not in axis_signs:
            points.append((node, f"drop {type(node.op).__name__}", line))
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            points.append((node, f"{node.value!r} -> {_changed(node.value)!r}", line))
    return points


def _changed(value: bool | int | float) -> bool | int | float:
    if isinstance(value, bool):
        return not value
    return value + 1


def mutate(source: str, index: int) -> tuple[str, str, int]:
    """`source` with mutant `index` applied: (new source, description, line)."""
    tree = ast.parse(source)
    node, desc, line = mutation_points(tree)[index]
    if isinstance(node, ast.BinOp | ast.BoolOp):
        node.op = SWAPS[type(node.op)]()
    elif isinstance(node, ast.Compare):
        i = int(desc.split(":")[0])
        node.ops[i] = SWAPS[type(node.ops[i])]()
    elif isinstance(node, ast.Constant):
        node.value = _changed(node.value)
    else:
        assert isinstance(node, ast.UnaryOp)
        _replace(tree, node, node.operand)
    return ast.unparse(tree), desc, line


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list) and any(v is old for v in value):
                setattr(parent, field, [new if v is old else v for v in value])


def run_tests(workdir: Path, tests: list[str], timeout: float) -> str:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "passed" if proc.returncode == 0 else "killed"


def scratch_copy() -> Path:
    dest = Path(tempfile.mkdtemp(prefix="smolgym-mutation-")) / "repo"
    ignore = shutil.ignore_patterns(".git", ".venv*", "smolgym-data", "__pycache__", ".*_cache", "*.egg-info")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


# ---- which tests run which lines -------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    """Loaded into the coverage run as a plugin: a test's own call is measured under its node id;
    collection and fixtures stay in the empty context, which counts as every test."""
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is None:
        return (yield)
    cov.switch_context(item.nodeid)
    try:
        return (yield)
    finally:
        cov.switch_context("")


def line_tests(workdir: Path, module: str, tests: list[str]) -> dict[int, set[str]] | None:
    """{line: node ids of the tests whose call executes it} for `module`, "" meaning every test (the line ran at
    import or in a fixture); None when `coverage` is missing or the tests fail unmutated."""
    if coverage is None:
        return None
    data_file, plugins = workdir.parent / ".coverage.mutation", workdir.parent / "plugins"
    plugins.mkdir(exist_ok=True)
    shutil.copy(__file__, plugins / f"{PLUGIN}.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "coverage", "run", f"--data-file={data_file}", f"--include={module}", "-m",
           "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN, *tests]  # fmt: skip
    if subprocess.run(cmd, cwd=workdir, capture_output=True, env=env, check=False).returncode != 0:
        return None
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    by_line: dict[int, set[str]] = {}
    for path in data.measured_files():
        for line, contexts in data.contexts_by_lineno(path).items():
            by_line.setdefault(line, set()).update(contexts)
    data_file.unlink(missing_ok=True)
    return by_line


def statement_lines(tree: ast.Module) -> dict[int, range]:
    """id(node) -> the lines coverage may report for it: its own lines and its statement's (a compound
    statement's header only, not its body)."""
    spans: dict[int, range] = {}

    def visit(node: ast.AST, stmt: range) -> None:
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body and isinstance(body[0], ast.AST) else None
            stmt = range(node.lineno, max(node.lineno, end or node.end_lineno or node.lineno) + 1)
        lines = getattr(node, "lineno", None)
        if lines is not None:
            own = range(node.lineno, (node.end_lineno or node.lineno) + 1)  # type: ignore[attr-defined]
            spans[id(node)] = range(min(own.start, stmt.start), max(own.stop, stmt.stop))
        for child in ast.iter_child_nodes(node):
            visit(child, stmt)

    visit(tree, range(0))
    return spans


def tests_for(node_lines: range, by_line: dict[int, set[str]]) -> set[str] | None:
    """The tests that execute any of `node_lines`; None = every test; empty = no test runs them."""
    found = set().union(*(by_line.get(line, set()) for line in node_lines))
    return None if "" in found else found


# ---- one module ------------------------------------------------------------------------------------


def pick(total: int, max_mutants: int | None, seed: int | None) -> list[int]:
    """Mutant indices to run: all, an even spread of `max_mutants`, or (with `seed`) a random sample of them."""
    if max_mutants is None or total <= max_mutants:
        return list(range(total))
    if seed is not None:
        return sorted(random.Random(seed).sample(range(total), max_mutants))
    return sorted({round(i * (total - 1) / (max_mutants - 1)) for i in range(max_mutants)})


def score_module(workdir: Path, module: str, tests: list[str], opts: argparse.Namespace) -> dict:
    path = workdir / module
    original = path.read_text()
    start = time.monotonic()
    if run_tests(workdir, tests, 1800) != "passed":
        return {"module": module, "error": "the tests fail without any mutant"}
    timeout = max(60.0, 3 * (time.monotonic() - start))
    by_line = None if opts.all_tests else line_tests(workdir, module, tests)
    tree = ast.parse(original)
    points, spans = mutation_points(tree), statement_lines(tree)
    picked = pick(len(points), opts.max_mutants, opts.seed)
    if opts.survivors:  # only the mutants an earlier run of this module left alive
        earlier = json.loads((opts.survivors / f"{module.replace('/', '.')}.json").read_text())["survivors"]
        alive = {(entry["line"], entry["change"]) for entry in earlier}
        picked = [i for i in picked if (points[i][2], points[i][1]) in alive]
    outcomes = {"killed": 0, "timeout": 0, "unexecuted": 0}
    survivors, run = [], 0
    sound: dict[frozenset[str], bool] = {}  # subsets run on the unmutated module: did they pass?
    try:
        for index in picked:
            if opts.time_limit and time.monotonic() - start > opts.time_limit:
                break
            node = points[index][0]
            subset = None if by_line is None else tests_for(spans[id(node)], by_line)
            if subset and not _subset_passes(subset, sound, lambda: path.write_text(original), workdir, tests, timeout):
                subset = None  # these tests fail together without any mutant (test order): run them all instead
            source, desc, line = mutate(original, index)
            path.write_text(source)
            run += 1
            result = run_mutant(workdir, tests, subset, timeout)
            if result in ("passed", "unexecuted"):
                survivors.append({"line": line, "change": desc, "executed": result == "passed"})
            if result != "passed":
                outcomes[result] += 1
            print(f"{module}:{line} {desc}: {result}", file=sys.stderr, flush=True)
    finally:
        path.write_text(original)
    killed = outcomes["killed"] + outcomes["timeout"]
    return {
        "module": module, "mutants": len(points), "run": run, "killed": killed, "timeouts": outcomes["timeout"],
        "unexecuted": outcomes["unexecuted"], "score": round(killed / run, 3) if run else None,
        "seconds": round(time.monotonic() - start), "survivors": survivors, "tests": tests,
    }  # fmt: skip


def _subset_passes(
    subset: set[str],
    sound: dict[frozenset[str], bool],
    restore: Callable[[], object],
    workdir: Path,
    tests: list[str],
    timeout: float,
) -> bool:
    """Whether `subset` passes on the unmutated module (run once per subset): a subset that fails alone, by
    test order (a test whose check depends on what ran before it in the process), would count every mutant
    run on it as killed."""
    key = frozenset(subset)
    if key not in sound:
        restore()
        flags = [t for t in tests if t.startswith("-")]
        sound[key] = run_tests(workdir, [*flags, *sorted(subset)], timeout) == "passed"
        if not sound[key]:
            print(f"tests failing together without a mutant: {sorted(subset)}", file=sys.stderr, flush=True)
    return sound[key]


def run_mutant(workdir: Path, tests: list[str], subset: set[str] | None, timeout: float) -> str:
    """killed / timeout / passed, running first only the tests that execute the mutated line (then, if they
    pass, all of them: a program compiled by one test may be what another asserts on)."""
    if subset is not None and not subset:
        return "unexecuted"
    if subset is not None:
        flags = [t for t in tests if t.startswith("-")]  # -k and the like apply to the subset too
        result = run_tests(workdir, [*flags, *sorted(subset)], timeout)
        if result != "passed":
            return result
    return run_tests(workdir, tests, timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", nargs="+", default=list(TARGETS), help="modules to mutate (default: all targets)")
    p.add_argument("--tests", nargs="+", help="pytest arguments to run instead of the module's own list")
    p.add_argument("-k", dest="keyword", help="pytest -k expression applied to the module's tests")
    p.add_argument("--max-mutants", type=int, help="run at most this many mutants per module, evenly spread")
    p.add_argument("--seed", type=int, help="with --max-mutants: a random sample drawn with this seed instead")
    p.add_argument("--time-limit", type=float, help="seconds per module after which no new mutant starts")
    p.add_argument("--all-tests", action="store_true", help="run every test for every mutant (no coverage map)")
    p.add_argument("--json-dir", type=Path, help="also write each module's result to DIR/<module>.json")
    p.add_argument("--survivors", type=Path, help="run only the survivors in an earlier --json-dir DIR")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = p.parse_args(argv)
    for module in args.modules:
        if module not in TARGETS and not args.tests:
            p.error(f"{module}: no tests listed for it; pass --tests")
    if args.list:
        for module in args.modules:
            tree = ast.parse((ROOT / module).read_text())
            for _, desc, line in mutation_points(copy.deepcopy(tree)):
                print(f"{module}:{line} {desc}")
        return 0
    workdir = scratch_copy()
    try:
        for module in args.modules:
            tests = [*(args.tests or TARGETS[module]), *(["-k", args.keyword] if args.keyword else [])]
            result = score_module(workdir, module, tests, args)
            print(json.dumps(result), flush=True)
            if args.json_dir:
                args.json_dir.mkdir(parents=True, exist_ok=True)
                (args.json_dir / f"{module.replace('/', '.')}.json").write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(workdir.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
