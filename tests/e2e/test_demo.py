"""CI smoke test: `python -m tx.demo` (tiny model, real server subprocess, SDK example loops) exits 0."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tx.demo", "--steps", "3", "--port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("mean reward") == 3, out[-4000:]
    assert "loss/token" in out and "demo finished" in out
