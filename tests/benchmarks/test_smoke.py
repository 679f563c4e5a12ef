"""CI smoke test: every benchmark script runs at its smallest size, exits 0 and prints valid JSON.

No timing is asserted: the point is that the scripts keep working as the code under them changes.
Sizes come from `benchmarks/run_all.py` (its `--quick` arguments), so CI and `run_all --quick` agree.
Each script runs as its own process with the test session's simulated-device XLA flag removed, as a
developer would run it by hand.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load_run_all() -> Any:
    spec = importlib.util.spec_from_file_location("benchmarks_run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


RUN_ALL = load_run_all()


def child_env() -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


def strict_json(text: str) -> list[Any]:
    """The JSON values `text` consists of (one document or several, e.g. one per line); anything else fails."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


@pytest.mark.parametrize("name", list(RUN_ALL.SCRIPTS))
def test_benchmark_quick(name: str) -> None:
    proc = run([str(BENCHMARKS / f"{name}.py"), *RUN_ALL.SCRIPTS[name][1]], timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    values = strict_json(proc.stdout)
    assert values and all(isinstance(v, dict) for v in values), proc.stdout[-2000:]
    if name == "load":  # the load smoke asserts counts (never times): nothing failed, lost or ran twice
        result = values[-1]
        assert sum(result["failed"].values()) == 0, result["failures"]
        assert result["lost"] == 0 and result["duplicated"] == 0
        assert min(result["completed"].values()) >= result["clients"]


def test_run_all_writes_markdown(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    proc = run([str(BENCHMARKS / "run_all.py"), "--quick", "--only", "packing_waste", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = strict_json(proc.stdout)[-1]
    assert summary["scripts"]["packing_waste"]["returncode"] == 0
    text = out.read_text()
    assert text.startswith("# SmolGym benchmark results") and "**jax**" in text and "**cpu**" in text
    assert "| datums |" in text and "## packing_waste" in text


def test_rates_are_written_with_their_fractions_of_the_runs_limits() -> None:
    limits = {"fp32_matmul_peak_gflops_per_s": 200.0, "read_bandwidth_gb_s": 20.0}
    sampled = RUN_ALL.with_fractions({"tokens_per_s": 9.0, "gflops_per_s": 50.0, "gb_per_s": 5.0}, limits)
    assert sampled == {"tokens_per_s": 9.0, "gflops_per_s": 50.0, "gb_per_s": 5.0,
                       "of_matmul_peak": 0.25, "of_read_bandwidth": 0.25, "of_roofline": 0.5}  # fmt: skip
    assert RUN_ALL.with_fractions({"active_gflops_per_s": 100}, limits)["of_roofline"] == 0.5
    assert RUN_ALL.with_fractions({"requests_per_s": 9.0}, limits) == {"requests_per_s": 9.0}
    assert RUN_ALL.with_fractions({"gflops_per_s": 50.0}, {}) == {"gflops_per_s": 50.0}  # limits.py failed
    rows = [{"mode": "r8", "gflops_per_s": 50.0}, {"mode": "full", "gflops_per_s": 100.0}]
    text = RUN_ALL.render({"cpu": "x"}, [RUN_ALL.Outcome("train", [], 0, 1.0, [{"results": rows}])], False, limits)
    assert "matmul peak 200.0 GFLOP/s" in text and "| full | 100.0 | 0.5 | 0.5 |" in text


def test_json_values_reads_lines_and_documents() -> None:
    text = 'progress\n{"a": 1}\n{"b": [1, 2]}\n{\n "c": {"d": 3}\n}\n'
    assert RUN_ALL.json_values(text) == [{"a": 1}, {"b": [1, 2]}, {"c": {"d": 3}}]
    assert strict_json(text.split("\n", 1)[1]) == RUN_ALL.json_values(text)


def load_device_check() -> Any:
    spec = importlib.util.spec_from_file_location("benchmarks_device_check", BENCHMARKS / "device_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def device_check(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**child_env(), "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(BENCHMARKS / "device_check.sh"), "--dry-run", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "device_check.json").read_text())


def test_device_check_dry_run(tmp_path: Path) -> None:
    """Every stage of the GPU check runs on CPU at tiny sizes and lands in the JSON and the markdown."""
    proc, doc = device_check(tmp_path, timeout=400)
    stages = {stage["name"]: stage for stage in doc["stages"]}
    assert {name: s["status"] for name, s in stages.items()} == {
        "parity": "ok", "train_lora_r32": "ok", "sample": "ok", "train_full": "ok", "lora_kernels": "ok",
        "qwen3.5": "ok",
    }  # fmt: skip
    assert {"train", "decode"} <= set(stages["lora_kernels"]["results"][-1]["summary"])
    assert stages["parity"]["results"][0]["collected"] > 0
    trained = [stages[name]["results"] for name in ("train_lora_r32", "train_full", "qwen3.5")]
    assert [(row["mode"], row["shape"]) for rows in trained for row in rows] == [
        ("r32", "tiny"), ("full", "tiny"), ("r32", "qwen3.5-tiny"),
    ]  # fmt: skip
    assert [row["batch"] for row in stages["sample"]["results"]] == [1, 4]
    for row in stages["train_full"]["results"] + stages["sample"]["results"]:
        assert row["tokens_per_s"] > 0 and row["dtype"] == "bfloat16" and row["peak_memory_gib"] > 0
    text = (tmp_path / "device_check.md").read_text()
    assert "| sample | ok |" in text and "surogate" in text and "## train_full" in text
    assert "| qwen3.5 | ok |" in proc.stdout  # the summary is printed last


def test_device_check_stops_at_its_time_limit(tmp_path: Path) -> None:
    _, doc = device_check(tmp_path, "--time-limit-s", "1", timeout=120)
    assert {stage["status"] for stage in doc["stages"]} == {"skipped"}
    assert "time limit" in doc["stages"][0]["reason"]


def test_a_stage_past_its_time_is_stopped_and_keeps_its_output() -> None:
    check = load_device_check()
    code = "import time; print('{\"batch\": 1}', flush=True); time.sleep(60)"
    record = check.run_stage(check.Stage("slow", ["-c", code], 2, 0), 2, child_env())
    assert record.status == "timed out" and record.results == [{"batch": 1}] and record.seconds < 30


def test_parity_counts_from_the_summary_or_from_a_run_cut_short() -> None:
    check = load_device_check()
    verbose = "tests/a.py::x PASSED [ 10%]\ntests/a.py::y FAILED [ 20%]\ntests/b.py::z[gpu] SKIPPED (why) [ 30%]\n"
    finished = verbose + "FAILED tests/a.py::y - AssertionError\n==== 1 failed, 1 passed, 1 skipped in 3.1s ====\n"
    assert check.pytest_results(finished) == [
        {"failed": 1, "passed": 1, "skipped": 1, "failed_tests": ["tests/a.py::y"]}
    ]
    assert check.pytest_results(verbose) == [
        {"passed": 1, "failed": 1, "skipped": 1, "failed_tests": ["tests/a.py::y"]}
    ]
    collected = "<Module a>\n\n60/176 tests collected (116 deselected) in 9.1s\n"
    assert check.pytest_results(collected) == [{"deselected": 116, "collected": 60, "failed_tests": []}]


def test_the_stages_name_the_accelerator_jax_can_start() -> None:
    """jax 0.11 reads JAX_PLATFORMS=gpu as CUDA or ROCm and fails without ROCm: the first H200 run failed
    every stage so. The stages name CUDA; a dry run stays on the CPU."""
    check = load_device_check()
    assert check.child_env(False, "gpu", False)["JAX_PLATFORMS"] == "cuda"
    assert check.child_env(False, "tpu", False)["JAX_PLATFORMS"] == "tpu"
    assert check.child_env(True, "gpu", False)["JAX_PLATFORMS"] == "cpu"
