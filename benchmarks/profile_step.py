"""Where a training step's time goes: the engine's Trainer on a random-weight model under `jax.profiler`,
the trace's XLA ops summed by kind, as JSON.

A step (forward_backward + optim_step, as `train_throughput.py` runs it) is traced after `--warmup` steps;
the perfetto trace's per-op events are joined with the optimised HLO (`--xla_dump_to`, read back from a
temporary directory) to name each op's kind: `dot` (matrix products, alone or fused), `convolution`,
`ynn fusion` (XLA:CPU's YNNPACK matrix kernels with what is fused into them), `loop`/`input`/`output`
fusions (elementwise, reductions), `copy`/`transpose`, collectives, the rest. The
result: total traced op time per kind, its share of the step, and the `--top` costliest ops with their
kind and the HLO instruction's first line (shapes), so a change can be aimed at what the step spends on.
An op that multiplies matrices (a `dot`, alone or inside a fusion) also gets its GFLOP over the step (2 x
output elements x contracted size, times the calls in the trace: a layer scan's body runs once per layer)
and the GFLOP/s it ran at, to set beside the matmul peak `limits.py` measures.

    python benchmarks/profile_step.py --shape qwen3.5-small --mode r8
    python benchmarks/profile_step.py --shape small --mode full --top 25
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DUMP = tempfile.mkdtemp(prefix="smolgym-hlo-")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
).strip()

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402
from train_throughput import workload  # noqa: E402

from tx.engine.bank import AdapterBank  # noqa: E402
from tx.engine.trainer import Trainer  # noqa: E402
from tx.lora.layers import LoRASpec  # noqa: E402
from tx.protocol import AdamParams, LoraConfig  # noqa: E402
from tx.tuning import for_backend  # noqa: E402

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


def _module_name(path: Path) -> str:
    """The HLO module a dump file holds (`module_0113.jit__grad.cpu_after_optimizations.txt` -> `jit__grad`)."""
    return path.name.split(".", 1)[1].rsplit(".cpu_after", 1)[0].rsplit("_after", 1)[0]


def hlo_kinds(dump: str) -> dict[tuple[str, str], tuple[str, str]]:
    """{(module, instruction name): (kind, its line)} over every optimised module in the dump."""
    kinds: dict[tuple[str, str], tuple[str, str]] = {}
    for path in Path(dump).glob("*after_optimizations.txt"):
        module = _module_name(path)
        for line in path.read_text().splitlines():
            m = INSTRUCTION.match(line)
            if m:
                kind = "ynn fusion" if m.group(1).startswith("ynn_fusion") else kind_of(m.group(2))
                kinds[(module, m.group(1))] = (kind, line.strip()[:160])
    return kinds


COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
SHAPED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")
DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\).*?lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(dump: str) -> dict[tuple[str, str], float]:
    """{(module, instruction name): FLOPs of one call} for every dot and every fusion whose computation
    holds dots, over every optimised module in the dump."""
    flops: dict[tuple[str, str], float] = {}
    for path in Path(dump).glob("*after_optimizations.txt"):
        module = _module_name(path)
        flops.update({(module, name): f for name, f in _module_flops(path.read_text()).items()})
    return flops


def _module_flops(text: str) -> dict[str, float]:
    """One module's dots by name, and its fusions by the sum over the computation each calls."""
    per_computation: dict[str, float] = collections.defaultdict(float)
    flops: dict[str, float] = {}
    computation, shapes, calls = "", {}, {}
    for line in text.splitlines():
        if m := COMPUTATION.match(line):
            computation = m.group(1)
        if not (m := SHAPED.match(line)):
            continue
        shapes[m.group(1)] = _dims(m.group(2))
        if (d := DOT.search(line)) and d.group(2) in shapes:
            contracted = math.prod(shapes[d.group(2)][i] for i in _dims(d.group(3)))
            flops[m.group(1)] = 2.0 * math.prod(_dims(d.group(1))) * contracted
            per_computation[computation] += flops[m.group(1)]
        if c := re.search(r"calls=%([\w.\-]+)", line):
            calls[m.group(1)] = c.group(1)
    return flops | {name: per_computation[c] for name, c in calls.items() if per_computation[c]}


def kind_of(rhs: str) -> str:
    """The op's kind from the right-hand side of its HLO line."""
    op = re.search(r"\b([a-z][\w\-]*)\(", rhs)
    name = op.group(1) if op else "?"
    if name == "fusion":
        if "ynn_fusion" in rhs or "calls=%ynn" in rhs:
            return "ynn fusion"  # XLA:CPU's YNNPACK kernels: matrix products with what is fused around them
        fused = re.search(r"kind=k(\w+)", rhs)
        calls = re.search(r"calls=%?([\w.\-]+)", rhs)
        label = (fused.group(1) if fused else "?").lower()
        if calls and ("dot" in calls.group(1) or "gemm" in calls.group(1)):
            return "dot"
        return f"{label} fusion"
    return name


def trace_events(trace_dir: Path) -> list[dict[str, Any]]:
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    with gzip.open(files[-1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize(
    events: list[dict[str, Any]],
    kinds: dict[tuple[str, str], tuple[str, str]],
    top: int,
    flops: dict[tuple[str, str], float] | None = None,
) -> dict:
    """Op time by kind and by program (the events that name their HLO module), and the costliest ops
    (with the GFLOP and GFLOP/s of those that multiply matrices, given their `dot_flops`)."""
    per_op: collections.Counter[tuple[str, str]] = collections.Counter()
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in events:
        args = e.get("args") or {}
        key = (str(args.get("hlo_module", "")), e["name"])
        if key in kinds:
            per_op[key] += e["dur"] / 1e3
            calls[key] += 1
    per_kind: collections.Counter[str] = collections.Counter()
    per_module: collections.Counter[str] = collections.Counter()
    for key, ms in per_op.items():
        per_kind[kinds[key][0]] += ms
        per_module[key[0]] += ms
    total = sum(per_kind.values())
    return {
        "traced_op_ms": round(total, 2),
        "by_program_ms": {k: round(v, 2) for k, v in per_module.most_common()},
        "by_kind": {k: {"ms": round(v, 2), "share": round(v / total, 3)} for k, v in per_kind.most_common()},
        "top_ops": [
            {
                "program": m,
                "op": n,
                "ms": round(ms, 2),
                "calls": calls[(m, n)],
                "kind": kinds[(m, n)][0],
                **_rate((flops or {}).get((m, n), 0.0) * calls[(m, n)], ms),
                "hlo": kinds[(m, n)][1],
            }
            for (m, n), ms in per_op.most_common(top)
        ],
    }


def _rate(flop: float, ms: float) -> dict[str, float]:
    """The op's matrix-product GFLOP over the trace and its GFLOP/s; nothing for an op without products."""
    if not flop:
        return {}
    return {"gflop": round(flop / 1e9, 3), "gflops_per_s": round(flop / ms / 1e6, 1) if ms else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--mode", default="r8", help="rN (LoRA rank N) or full")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    from shapes import random_model

    rank = None if args.mode == "full" else int(args.mode[1:])
    model = random_model(
        args.shape, LoRASpec(slots=2, max_rank=rank or 1, kernel=for_backend().lora_kernel), args.dtype
    )
    trainer = Trainer(model, AdapterBank.of(model), micro_batch_tokens=max(args.batch * args.length, 2048))
    if rank is None:
        trainer.create_full_run("run")
    else:
        trainer.create_lora_run("run", LoraConfig(rank=rank), slot=1)
    request = workload(model.config.vocab_size, args.batch, args.length)

    def step() -> float:
        start = time.perf_counter()
        trainer.forward_backward([("run", request)])
        trainer.optim_step("run", AdamParams(learning_rate=1e-5))
        jax.block_until_ready((trainer.bank.arrays, trainer.runs["run"].params))
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    trace_dir = Path(tempfile.mkdtemp(prefix="smolgym-trace-"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        step_s = step()
    out = summarize(trace_events(trace_dir), hlo_kinds(DUMP), args.top, dot_flops(DUMP))
    print(json.dumps({"benchmark": "profile_step", **vars(args), "step_ms": round(step_s * 1e3, 1), **out}, indent=1))


if __name__ == "__main__":
    main()
