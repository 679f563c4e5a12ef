"""Mutation testing: plant one small bug at a time in a module, run that module's tests, count the kills.

A mutant changes one operator or constant (`<` -> `<=`, `+` -> `-`, `and` -> `or`, `not x` -> `x`,
`-x` -> `x`, `3` -> `4`, `0.5` -> `1.5`, `True` -> `False`) outside docstrings, f-strings, log calls and
annotations. Each runs in a scratch copy of the repository (the checkout is never written), as a fresh
`pytest -x` over the module's tests; it is killed when they fail or time out. Prints one JSON line per
module: mutants, killed, score and the survivors (line, change) to kill with a test or explain as
equivalent. Too slow for CI on 2 cores; run it before resolving an issue that touches these modules:
    python benchmarks/mutation.py --modules tx/api/validate.py
    python benchmarks/mutation.py --modules tx/engine/losses.py --max-mutants 40   # an even sample
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules where a silent bug costs users most, each with the tests that guard it.
TARGETS: dict[str, list[str]] = {
    "tx/engine/train_step.py": ["tests/engine/test_optim_reference.py", "tests/engine/test_trainer.py"],
    "tx/engine/losses.py": ["tests/engine/test_losses.py"],
    "tx/engine/sampling.py": ["tests/engine/test_sampling.py"],
    "tx/engine/weights_io.py": ["tests/e2e/test_peft_export.py", "tests/e2e/test_full_finetune.py"],
    "tx/lora/peft.py": ["tests/lora/test_peft.py"],
    "tx/db/queue.py": ["tests/db/test_db_queue.py", "tests/db/test_db_engine_loop.py"],
    "tx/api/validate.py": ["tests/api/test_validate_rules.py", "tests/api/test_api_validation.py"],
}
SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Pow: ast.Mult, ast.And: ast.Or, ast.Or: ast.And,
}  # fmt: skip
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


def mutation_points(tree: ast.Module) -> list[tuple[ast.AST, str, int]]:
    """(node, description, line) for every mutant of `tree`, in a fixed order."""
    skip, points = _skipped(tree), []
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
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
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


def score_module(workdir: Path, module: str, tests: list[str], max_mutants: int | None) -> dict:
    path = workdir / module
    original = path.read_text()
    start = time.monotonic()
    if run_tests(workdir, tests, 1800) != "passed":
        return {"module": module, "error": "the tests fail without any mutant"}
    timeout = max(60.0, 3 * (time.monotonic() - start))
    total = len(mutation_points(ast.parse(original)))
    picked = list(range(total))
    if max_mutants is not None and total > max_mutants:  # an even spread over the file
        picked = sorted({round(i * (total - 1) / (max_mutants - 1)) for i in range(max_mutants)})
    outcomes: dict[str, int] = {"killed": 0, "timeout": 0}
    survivors = []
    try:
        for index in picked:
            source, desc, line = mutate(original, index)
            path.write_text(source)
            result = run_tests(workdir, tests, timeout)
            if result == "passed":
                survivors.append({"line": line, "change": desc})
            else:
                outcomes[result] += 1
            print(f"{module}:{line} {desc}: {result}", file=sys.stderr, flush=True)
    finally:
        path.write_text(original)
    killed = outcomes["killed"] + outcomes["timeout"]
    return {
        "module": module, "mutants": total, "run": len(picked), "killed": killed, "timeouts": outcomes["timeout"],
        "score": round(killed / len(picked), 3) if picked else None, "survivors": survivors, "tests": tests,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", nargs="+", default=list(TARGETS), help="modules to mutate (default: all targets)")
    p.add_argument("--tests", nargs="+", help="tests to run instead of the module's own list")
    p.add_argument("--max-mutants", type=int, help="run at most this many mutants per module, evenly spread")
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
            result = score_module(workdir, module, args.tests or TARGETS[module], args.max_mutants)
            print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(workdir.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
