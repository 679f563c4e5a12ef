"""`python -m tx.demo` (tiny model, real server subprocess, SDK example loops) does what README.md says:
exits 0, the RL loop's mean reward rises within ten steps and the SL loop's loss falls."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_offline(tmp_path):
    # The demo runs in a scratch directory: put this checkout first on the path, or the children import
    # whichever `tx` the interpreter has installed (another checkout's, with an editable install).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "tx.demo", "--steps", "10", "--port", "0", "--seed", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rewards = [float(r) for r in re.findall(r"rl step +\d+ +mean reward ([\d.]+)", out)]
    losses = [float(x) for x in re.findall(r"sl step +\d+ +loss/token ([\d.]+)", out)]
    assert len(rewards) == len(losses) == 10 and "demo finished" in out, out[-4000:]
    # Seeded, so a machine repeats its run; the margins are wide because another CPU's rounding may take
    # another path (a typical run: 0.58 -> 1.0 and 6.3 -> 3.6). A group's mean reward has a spread of
    # about 0.06 around 0.55 when nothing is learned.
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > 0.8 and last > first + 0.2, rewards
    assert losses[-1] < 0.8 * losses[0] and losses[-1] < min(losses[:3]), losses


def test_a_server_that_cannot_start_is_a_one_line_failure(tmp_path, monkeypatch, capsys):
    """The server refusing to start (another engine holds the data directory, say) printed its reason, then
    the demo's own traceback, and never "demo failed"."""
    from tx import demo

    def exits_at_once(model_dir: Path, port: int, data_dir: Path, env: dict) -> subprocess.Popen:
        line = "error: another SmolGym engine is running on the data directory"
        return subprocess.Popen([sys.executable, "-c", f"print({line!r}); raise SystemExit(1)"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    monkeypatch.setattr(demo, "start_server", exits_at_once)
    monkeypatch.setattr(demo, "write_tiny_model", lambda path: path)
    assert demo.main(["--data-dir", str(tmp_path), "--port", "0"]) == 1
    out = capsys.readouterr().out
    assert "another SmolGym engine" in out and "before it was ready" in out and "demo failed" in out
    assert "Traceback" not in out
