"""Run every benchmark script, one at a time in its own process, and write their results as markdown.

Each script prints JSON on stdout (one document, or one object per line); this collects every JSON value
it printed and renders one section per script, headed by a description of the machine (CPU model,
cores, memory, jax version and backend, date, commit). A script that fails is reported in its section
with the tail of its stderr, and the others still run. Prints a JSON summary (exit code and seconds
per script) on stdout; exits 1 if any script failed.

Every row that reports a rate of work (`gflops_per_s` or `active_gflops_per_s`: FLOPs; `gb_per_s`: bytes
read) gets its fractions of the machine's limits beside it, measured by `limits.py` in this same run after
the scripts: `of_matmul_peak`, `of_read_bandwidth` and `of_roofline`, their sum (the time the roofline
allows over the time taken; a training step's is its compute share, a sampling round's both). Rows of
server-side rates (requests/s, RL steps/s) have no such limit.

    python benchmarks/run_all.py                         # full sizes -> benchmarks/results/run_all.md
    python benchmarks/run_all.py --quick --out /tmp/r.md # every script at its CI smoke size
    python benchmarks/run_all.py --only rl_loop host_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# script name -> (arguments for a full run, arguments for the smallest size CI can afford)
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "train_throughput": ([], ["--quick"]),
    "sample_throughput": ([], ["--quick"]),
    "bench_lora": ([], ["--quick"]),
    "bench_moe": (["--reps", "3"], ["--quick"]),
    "vs_transformers": ([], ["--quick"]),
    "packing_waste": ([], ["--datums", "16", "64", "--trials", "3"]),
    "api_submit": ([], ["--requests", "20", "--kb", "16"]),
    "rl_loop": ([], ["--quick"]),
    "tenants": ([], ["--quick"]),
    "ranks": ([], ["--quick"]),
    "host_overhead": ([], ["--quick"]),  # runs api_overhead.py against its own server (its "sdk" cases)
    "load": ([], ["--quick"]),
    "result_encoding": ([], ["--samples", "4", "--tokens", "64", "--prompt", "64", "--repeats", "1"]),
    "token_selection": ([], ["--batch", "8", "--vocab", "8192", "--repeats", "1"]),
    "profile_step": ([], ["--shape", "tiny", "--batch", "2", "--length", "32", "--warmup", "1", "--top", "5"]),
}


PEAK, BANDWIDTH = "fp32_matmul_peak_gflops_per_s", "read_bandwidth_gb_s"  # limits.py's keys
COMPUTE_RATES, READ_RATE = ("gflops_per_s", "active_gflops_per_s"), "gb_per_s"


@dataclass
class Outcome:
    name: str
    args: list[str]
    returncode: int
    seconds: float
    docs: list[Any] = field(default_factory=list)
    stderr_tail: str = ""


def json_values(text: str) -> list[Any]:
    """Every top-level JSON value in `text`, whether printed one per line or indented over many."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while i < len(text):
        start = min((j for j in (text.find("{", i), text.find("[", i)) if j >= 0), default=-1)
        if start < 0:
            break
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        values.append(value)
        i = end
    return values


def run_script(name: str, args: list[str], timeout: float) -> Outcome:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    print(f"[run_all] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = dict(os.environ, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, exc.stdout or ""
        err = f"{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
        out, err = (s.decode() if isinstance(s, bytes) else s for s in (out, err))
    seconds = time.perf_counter() - start
    docs = json_values(out)
    if code == 0 and not docs:
        code, err = 1, err + "\nno JSON on stdout"
    return Outcome(name, args, code, round(seconds, 1), docs, "\n".join(err.strip().splitlines()[-15:]))


def machine(found: dict[str, str] | None = None) -> dict[str, str]:
    """The machine's description; `found`: a `jax_probe()` already made."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "python": platform.python_version()}
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    info["cpu"] = models[0] if models else platform.processor() or platform.machine()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info["cores"] = f"{usable} usable of {os.cpu_count()}"
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    found = jax_probe()
    info["jax"] = (
        f"{found['jax']}, backend {found['backend']}, {found['devices']}" if "devices" in found else "unavailable"
    )
    try:  # a copy of the tree without git (a device machine) has no commit to name
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        info["commit"] = commit.stdout.strip() or "unknown"
    except OSError:
        info["commit"] = "unknown"
    return info


def jax_probe(env: dict[str, str] | None = None) -> dict[str, str]:
    """JAX's version, default backend and devices, asked in a child process so this one never takes the
    accelerator from the benchmarks."""
    probe = "import jax; d = jax.devices(); print(jax.__version__, jax.default_backend(), len(d), d[0].device_kind)"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"jax": "unavailable", "backend": "cpu", "error": proc.stderr.strip()[-500:]}
    version, backend, count, kind = proc.stdout.split(maxsplit=3)
    return {"jax": version, "backend": backend, "devices": f"{count} x {kind.strip()}"}


def rows_of(doc: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(table rows, scalar context) of one JSON document."""
    if not isinstance(doc, dict):
        return [{"value": doc}], {}
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict | list)}
    if isinstance(doc.get("results"), list):
        return [flatten(r) for r in doc["results"]], scalars
    records = {k: v for k, v in doc.items() if isinstance(v, dict)}
    if len(records) > 1 and len({tuple(v) for v in records.values()}) == 1:
        return [{"case": k, **flatten(v)} for k, v in records.items()], scalars
    return [flatten(doc)], {}


def flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(flatten(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def table(rows: list[dict[str, Any]]) -> list[str]:
    if len(rows) == 1:  # one record reads better vertically
        lines = ["| metric | value |", "|---|---|"]
        return lines + [f"| {k} | {cell(v)} |" for k, v in rows[0].items()]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]


def cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, list) else str(value)
    return text.replace("|", "\\|")


def measure_limits(quick: bool, timeout: float) -> dict[str, float]:
    """The matmul peak and read bandwidth, from `limits.py` in a child process ({} if it fails)."""
    outcome = run_script("limits", ["--quick"] if quick else [], timeout)
    doc = outcome.docs[-1] if outcome.returncode == 0 and outcome.docs else {}
    return {key: doc[key] for key in (PEAK, BANDWIDTH) if isinstance(doc.get(key), int | float) and doc[key] > 0}


def reports_rates(outcomes: list[Outcome]) -> bool:
    return any(f'"{key}"' in json.dumps(o.docs) for o in outcomes for key in (*COMPUTE_RATES, READ_RATE))


def with_fractions(row: dict[str, Any], limits: dict[str, float]) -> dict[str, Any]:
    """`row` and, when it reports rates of work, their fractions of `limits` (see the module docstring)."""
    compute = next((row[k] for k in COMPUTE_RATES if isinstance(row.get(k), int | float)), None)
    read = row.get(READ_RATE) if isinstance(row.get(READ_RATE), int | float) else None
    fractions = {}
    if compute is not None and PEAK in limits:
        fractions["of_matmul_peak"] = compute / limits[PEAK]
    if read is not None and BANDWIDTH in limits:
        fractions["of_read_bandwidth"] = read / limits[BANDWIDTH]
    if fractions:
        fractions["of_roofline"] = sum(fractions.values())
    return {**row, **{key: round(value, 3) for key, value in fractions.items()}}


def section(outcome: Outcome, limits: dict[str, float]) -> list[str]:
    lines = [f"## {outcome.name}", "", f"`{' '.join([outcome.name + '.py', *outcome.args])}`: {outcome.seconds} s", ""]
    if outcome.returncode != 0:
        return lines + [f"**failed** (exit code {outcome.returncode})", "", "```", outcome.stderr_tail, "```", ""]
    docs = outcome.docs
    if any(isinstance(d, dict) and isinstance(d.get("results"), list) for d in docs):
        docs = [d for d in docs if isinstance(d, dict) and "results" in d]  # the per-row lines repeat them
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for doc in docs:
        rows, context = rows_of(doc)
        if context:
            lines += [", ".join(f"{k}: {v}" for k, v in context.items()), ""]
        for row in (with_fractions(row, limits) for row in rows):
            groups.setdefault(tuple(row), []).append(row)
    for rows in groups.values():
        lines += [*table(rows), ""]
    return lines


def render(info: dict[str, str], outcomes: list[Outcome], quick: bool, limits: dict[str, float]) -> str:
    lines = ["# SmolGym benchmark results", ""]
    lines += [f"- **{key}**: {value}" for key, value in info.items()]
    lines += [f"- **sizes**: {'quick (CI smoke sizes)' if quick else 'full'}"]
    if limits:
        lines += [f"- **limits, measured in this run**: float32 matmul peak {limits.get(PEAK)} GFLOP/s, read bandwidth "
                  f"{limits.get(BANDWIDTH)} GB/s (the `of_*` columns are each row's rates over them)"]  # fmt: skip
    lines += [""]
    for outcome in outcomes:
        lines += section(outcome, limits)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="run every script at its smallest size")
    p.add_argument(
        "--out", type=Path, default=HERE / "results" / "run_all.md", help="default benchmarks/results/run_all.md"
    )
    p.add_argument("--only", nargs="+", choices=list(SCRIPTS), help="run only these scripts")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per script (default 3600)")
    args = p.parse_args(argv)
    outcomes = [
        run_script(name, SCRIPTS[name][1 if args.quick else 0], args.timeout)
        for name in SCRIPTS
        if not args.only or name in args.only
    ]
    limits = measure_limits(args.quick, args.timeout) if reports_rates(outcomes) else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(machine(), outcomes, args.quick, limits))
    summary = {o.name: {"returncode": o.returncode, "seconds": o.seconds} for o in outcomes}
    print(json.dumps({"benchmark": "run_all", "out": str(args.out), "limits": limits, "scripts": summary}), flush=True)
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
