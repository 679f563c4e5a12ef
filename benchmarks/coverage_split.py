"""Line and branch coverage of `tx` per package, for the real-engine tests and the fake-runner tests apart.

The API tests in tests/api run against `FakeRunner` (tests/api/fake_runner.py), which answers without
the engine: code that only they reach is checked against a stand-in. This runs each group under
`coverage run --branch` and prints one JSON document: per group and package, line and branch percent;
and per package, the lines only the fake-runner group executes (`fake_only`), the files with most of
them first. Needs `coverage` (in the dev extras). Child processes (the demo, the old-SDK client) are not
measured. The whole suite twice takes a while on 2 cores; pass smaller groups to look at one area:
    python benchmarks/coverage_split.py
    python benchmarks/coverage_split.py --real tests/engine/test_losses.py --fake tests/api/test_api_validation.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ["tests/api", "--ignore=tests/api/test_api_e2e_jax.py"]
REAL = ["tests/engine", "tests/lora", "tests/models", "tests/db", "tests/e2e", "tests/api/test_api_e2e_jax.py"]


def measure(tests: list[str], workdir: Path, name: str) -> dict:
    """coverage's JSON report of `pytest tests` over the `tx` package."""
    data, report = workdir / f".coverage.{name}", workdir / f"{name}.json"
    run = [sys.executable, "-m", "coverage", "run", "--branch", "--source=tx", f"--data-file={data}"]
    pytest = [*run, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    subprocess.run(pytest, cwd=ROOT, check=False, stdout=sys.stderr)  # stdout carries only the report
    cmd = [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(report), "-q"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
    return json.loads(report.read_text())["files"]


def package_of(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def per_package(files: dict) -> dict[str, dict[str, float | None]]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for path, entry in files.items():
        s = entry["summary"]
        acc = sums[package_of(path)]
        acc[0] += s["covered_lines"]
        acc[1] += s["num_statements"]
        acc[2] += s.get("covered_branches", 0)
        acc[3] += s.get("num_branches", 0)
    return {pkg: {"lines": _pct(c, n), "branches": _pct(cb, nb)} for pkg, (c, n, cb, nb) in sorted(sums.items())}


def _pct(covered: int, total: int) -> float | None:
    return round(100 * covered / total, 1) if total else None


def fake_only(real: dict, fake: dict) -> dict[str, dict]:
    """Per package: how many lines only the fake-runner tests execute, and in which files."""
    out: dict[str, dict] = defaultdict(lambda: {"lines": 0, "files": {}})
    for path, entry in fake.items():
        seen = set(real.get(path, {}).get("executed_lines", []))
        only = sorted(set(entry["executed_lines"]) - seen)
        if only:
            pkg = out[package_of(path)]
            pkg["lines"] += len(only)
            pkg["files"][path] = only
    for pkg in out.values():
        ranked = sorted(pkg["files"].items(), key=lambda kv: -len(kv[1]))
        pkg["files"] = {path: _ranges(lines) for path, lines in ranked}
    return dict(sorted(out.items()))


def _ranges(lines: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    spans: list[list[int]] = []
    for line in lines:
        if spans and line == spans[-1][1] + 1:
            spans[-1][1] = line
        else:
            spans.append([line, line])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", nargs="+", default=REAL, help="pytest arguments of the real-engine group")
    p.add_argument("--fake", nargs="+", default=FAKE, help="pytest arguments of the fake-runner group")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="smolgym-coverage-") as tmp:
        real, fake = measure(args.real, Path(tmp), "real"), measure(args.fake, Path(tmp), "fake")
    report = {
        "real_engine": per_package(real),
        "fake_runner": per_package(fake),
        "fake_only": fake_only(real, fake),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
