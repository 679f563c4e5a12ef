"""The device check: training and sampling at GPU sizes, then parity tests on the accelerator, in a time limit.

Stages run one at a time, each in its own process (its own peak memory; a stage that hangs or runs out of
time is killed and recorded, and the next one still runs): Qwen3-0.6B-shape LoRA r32 training, sampling at
batch 1/64/256/1024 and full fine-tuning (`train_throughput.py`, `sample_throughput.py`), random weights in
bfloat16; Qwen3.5 LoRA r32 training at the 9B's layer width over one group of its layers (`qwen3.5-9b-d4`);
the multi-adapter kernel forms side by side (`bench_lora.py`: the measurement the accelerator rows of
`tx.tuning` wait for); last, the `parity or device` tests with what time is left. A stage starts only while
enough of the time limit is left, and gets at most what is left. After every stage `device_check.json`
(every number) and `device_check.md` (a summary against the published anchors, then one table per stage)
are rewritten under `--out-dir`, so a run cut short still leaves what it measured. `--dry-run` runs the
same stages on CPU at tiny sizes and only collects the tests (CI runs it). `device_check.sh` installs first.

    python benchmarks/device_check.py --dry-run --out-dir /tmp/dc
    python benchmarks/device_check.py --time-limit-s 420 --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import run_all  # noqa: E402

TEST_DIRS = ["tests/models", "tests/engine", "tests/lora"]  # the parity tests; tests/api needs the server's packages
ANCHORS = {
    "train_lora_r32": "Qwen3-0.6B LoRA: surogate 62-65k tok/s, Unsloth 22-25k (one H100/H200)",
    "sample": "SkyRL: 88k tok/s at batch 2048 on one H100",
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    shape: str
    dtype: str
    train: tuple[int, int, int]  # batch, length, steady steps
    batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    hybrid: str  # the Qwen3.5 (Gated DeltaNet) shape of the last stage's LoRA training


# 8 x 1024 tokens a step: ~35 GB at peak by count (fp32 logits and their gradient 5 GB each, attention
# probabilities 0.5 GB a layer), well inside the H200's 139 GB.
GPU = Sizes("qwen3-0.6b", "bfloat16", (8, 1024, 3), (1, 64, 256, 1024), 128, 128, "qwen3.5-9b-d4")
DRY = Sizes("tiny", "bfloat16", (2, 32, 1), (1, 4), 16, 8, "qwen3.5-tiny")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    command: list[str]  # after the Python interpreter; empty: always skipped with `reason`
    cap_s: float  # the most seconds it may take
    min_s: float  # fewer seconds left than this: skipped
    reason: str = ""


def stages(sizes: Sizes, dry: bool) -> list[Stage]:
    batch, length, steps = sizes.train
    shape = ["--batch", str(batch), "--length", str(length), "--steps", str(steps), "--dtype", sizes.dtype]
    train = [str(HERE / "train_throughput.py"), *shape, "--shape", sizes.shape, "--modes"]
    hybrid = [str(HERE / "train_throughput.py"), *shape, "--shape", sizes.hybrid, "--modes", "r32"]
    sample = [str(HERE / "sample_throughput.py"), "--shapes", sizes.shape, "--dtype", sizes.dtype, "--variants"]
    sample += ["lora", "--repeats", "1", "--prompt", str(sizes.prompt), "--new-tokens", str(sizes.new_tokens)]
    tests = ["-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-m", "parity or device", *TEST_DIRS]
    kernels = [str(HERE / "bench_lora.py"), "--dtype", sizes.dtype, *(["--quick"] if dry else [])]
    # The numbers first, the parity tests last with whatever time is left (on the first H200 they covered 17%
    # of the tests in 120 s: a lease cannot hold them all); sampling before full fine-tuning: if time runs
    # short, the LoRA numbers (the server's main use) come first.
    return [
        Stage("train_lora_r32", [*train, "r32"], 100, 40),
        Stage("sample", [*sample, "--batches", *map(str, sizes.batches)], 180, 60),
        Stage("train_full", [*train, "full"], 100, 40),
        Stage("qwen3.5", hybrid, 150, 60),  # the 9B's layer width, one group of its 3 linear : 1 full pattern
        # The three multi-adapter kernel forms side by side: the measurement `tx.tuning` waits for.
        Stage("lora_kernels", kernels, 60, 20),
        Stage("parity", [*tests, "--collect-only", "-q"] if dry else tests, 120, 30),
    ]


@dataclasses.dataclass
class Record:
    name: str
    status: str  # ok, failed, timed out, skipped
    seconds: float = 0.0
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reason: str = ""


def child_env(dry: bool, backend: str, pytest: bool) -> dict[str, str]:
    """The repo's own `tx` first on the path; CPU for a dry run, else the accelerator named explicitly (the
    tests' conftest would choose CPU); float32 matmuls in full precision for the float32 parity tests (GPUs
    round them to TF32 by default)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["JAX_PLATFORMS"] = "cpu" if dry else {"gpu": "cuda"}.get(backend, backend)  # "gpu" would also try rocm
    if dry:  # the test session's simulated devices do not apply to a benchmark process
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f)
    if pytest:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    return env


def run_stage(stage: Stage, timeout: float, env: dict[str, str]) -> Record:
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, *stage.command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = 124, _text(exc.stdout), _text(exc.stderr) + f"\nstopped at the time limit ({timeout:.0f} s)"
    seconds = round(time.perf_counter() - start, 1)
    results = pytest_results(out) if stage.name == "parity" else benchmark_rows(out)
    status = {0: "ok", 124: "timed out"}.get(code, "failed")
    tail = "\n".join((out + "\n" + err).strip().splitlines()[-12:]) if code else ""
    return Record(stage.name, status, seconds, results, tail)


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def benchmark_rows(out: str) -> list[dict[str, Any]]:
    """The per-point JSON lines a benchmark printed (its final document repeats them: used only when the
    process finished)."""
    docs = [d for d in run_all.json_values(out) if isinstance(d, dict)]
    final = [d for d in docs if isinstance(d.get("results"), list)]
    if final:
        context = {k: v for k, v in final[-1].items() if not isinstance(v, dict | list)}
        return [{**row, **{f"run.{k}": v for k, v in context.items()}} for row in final[-1]["results"]]
    return docs


def pytest_results(out: str) -> list[dict[str, Any]]:
    """Counts from pytest's summary line (or `--collect-only`'s), else, for a run stopped before its summary,
    from the verbose per-test lines; and the failed tests' ids."""
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    if collected:
        counts["collected"] = int(collected.group(1))
    verdicts = re.findall(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR)", out, re.MULTILINE)
    if not counts:
        for _, verdict in verdicts:
            counts[verdict.lower()] = counts.get(verdict.lower(), 0) + 1
    failed = [test for test, verdict in verdicts if verdict in ("FAILED", "ERROR")]
    return [{**counts, "failed_tests": failed}]


def summary(record: Record) -> str:
    """One cell: what a stage measured, or why it did not."""
    if record.status == "skipped" or not record.results:
        return record.reason.splitlines()[-1] if record.reason else record.status
    if record.name == "parity":
        counts = {k: v for k, v in record.results[0].items() if k != "failed_tests"}
        return ", ".join(f"{v} {k}" for k, v in counts.items())
    winners = [row["summary"] for row in record.results if "summary" in row]
    if winners:  # bench_lora: the fastest kernel form per workload
        return "; ".join(f"{w}: {s['winner']} {s['geomean_ms']}" for w, s in winners[-1].items())
    return "; ".join(point(row) for row in record.results)


def point(row: dict[str, Any]) -> str:
    where = f"batch {row['batch']}: " if "variant" in row else ""
    compile_s = row.get("compile_s", "?")
    return f"{where}{row.get('tokens_per_s')} tok/s, compile {compile_s} s, peak {row.get('peak_memory_gib')} GiB"


def markdown(info: dict[str, Any], records: list[Record]) -> str:
    lines = ["# SmolGym device check", ""] + [f"- **{k}**: {v}" for k, v in info.items()] + [""]
    lines += ["| stage | status | seconds | result | published anchor |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds} | {run_all.cell(summary(r))} | {ANCHORS.get(r.name, '')} |"
        )
    for r in records:
        if r.results:
            lines += ["", f"## {r.name}", "", *run_all.table([run_all.flatten(row) for row in r.results])]
        if r.status in ("failed", "timed out"):
            lines += ["", f"## {r.name}: {r.status}", "", "```", r.reason, "```"]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, info: dict[str, Any], records: list[Record]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "device_check", "machine": info, "stages": [dataclasses.asdict(r) for r in records]}
    (out_dir / "device_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "device_check.md").write_text(markdown(info, records))


def run_stages(args: argparse.Namespace, info: dict[str, Any], start: float) -> list[Record]:
    records: list[Record] = []
    for stage in stages(DRY if args.dry_run else GPU, args.dry_run):
        left = args.time_limit_s - (time.monotonic() - start) - RESERVE_S
        print(f"[device_check] {stage.name}: {left:.0f} s left", file=sys.stderr, flush=True)
        if not stage.command:
            record = Record(stage.name, "skipped", reason=stage.reason)
        elif left < stage.min_s:
            record = Record(stage.name, "skipped", reason=f"skipped: {left:.0f} s left of the time limit")
        else:
            env = child_env(args.dry_run, info["backend"], stage.name == "parity")
            record = run_stage(stage, min(stage.cap_s, left), env)
        records.append(record)
        print(f"[device_check] {stage.name}: {record.status} ({record.seconds} s) {summary(record)}", flush=True)
        write(args.out_dir, info, records)
    return records


RESERVE_S = 5.0  # kept back for writing the results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, tests collected only")
    p.add_argument("--time-limit-s", type=float, default=420.0, help="stop starting stages past this (default 420)")
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results"
    p.add_argument("--out-dir", type=Path, default=default_out, help="default $OUT, else benchmarks/results")
    args = p.parse_args(argv)
    start = time.monotonic()
    sizes = DRY if args.dry_run else GPU
    found = run_all.jax_probe(child_env(args.dry_run, "", False))
    info: dict[str, Any] = {**run_all.machine(found), **found}
    info.update(time_limit_s=args.time_limit_s, sizes=dataclasses.asdict(sizes), dry_run=args.dry_run)
    records = run_stages(args, info, start)
    print(markdown(info, records).split("\n## ")[0], flush=True)
    return 1 if any(r.status == "failed" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
