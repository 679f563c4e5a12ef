"""The tinker-cookbook 0.6.1 recipes, unmodified, against one real server under their default model names.

Offline: `cookbook_offline.py` publishes two tiny hub-style Qwen3.5 checkpoints (vision tower included) in a
private HF cache as `Qwen/Qwen3.5-9B-Base` (the recipes' student and SFT default) and `Qwen/Qwen3.5-9B` (the
distillation teacher), with stand-ins for the datasets. The server preloads only the student; the
on-policy distillation recipe names the teacher, which the server loads on demand while the student keeps
its run. Then `sl_loop`, `rl_loop` (its default loss) and `chat_sl` train on the same server. The recipes
run in their own interpreter (SMOLGYM_COOKBOOK_PYTHON; `.ci/cookbook.sh` builds it), skipped where it does
not exist except under CI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.conftest import KEY, _free_port
from e2e.test_roles import wait_ready

pytestmark = pytest.mark.e2e

COOKBOOK_PYTHON = Path(os.environ.get("SMOLGYM_COOKBOOK_PYTHON", ".venv-cookbook/bin/python")).absolute()
OFFLINE = Path(__file__).with_name("cookbook_offline.py")
STUDENT, TEACHER = "Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-9B"


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(
    not COOKBOOK_PYTHON.exists() and not os.environ.get("CI"), reason=f"no cookbook interpreter at {COOKBOOK_PYTHON}"
)
def test_distillation_with_an_on_demand_teacher_then_sl_loop(tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "JAX_PLATFORMS": "cpu"}  # fmt: skip
    for name, seed in ((STUDENT, 0), (TEACHER, 1)):
        model = tmp_path / f"model-{seed}"
        args = [str(OFFLINE), "--tiny-qwen3-5", str(model), "--seed", str(seed), "--hf-home", str(hf_home)]
        subprocess.run([str(COOKBOOK_PYTHON), *args, "--model-name", name], env=env, check=True, capture_output=True)
    port, log = _free_port(), tmp_path / "server.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "tx.api", "--base-model", STUDENT, "--max-seq-len", "512", "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        wait_ready(server, log, "SmolGym ready on")
        url = f"base_url=http://127.0.0.1:{port}"
        recipes = {
            "distillation": ["tinker_cookbook.recipes.distillation.on_policy_distillation", "groups_per_batch=2",
                             "group_size=2", "max_tokens=24", "max_steps=2"],
            "sl_loop": ["tinker_cookbook.recipes.sl_loop", "batch_size=16", "max_steps=2"],
            "rl_loop": ["tinker_cookbook.recipes.rl_loop", "batch_size=2", "group_size=2", "max_tokens=16",
                        "max_steps=2"],  # its default loss
            "chat_sl": ["tinker_cookbook.recipes.chat_sl.train", "batch_size=16", "max_steps=2", "eval_every=1000",
                        "infrequent_eval_every=1000", "save_every=1000"],
        }  # fmt: skip
        for name, (module, *options) in recipes.items():
            command = [str(COOKBOOK_PYTHON), "-m", module, url, *options, f"log_path={tmp_path / name}"]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
            assert proc.returncode == 0, f"{name}:\n{proc.stderr[-4000:]}\n{log.read_text()[-2000:]}"
    finally:
        server.terminate()
        server.wait(30)
    distilled = _metrics(tmp_path / "distillation")
    assert [m["step"] for m in distilled] == [0, 1]
    # teacher_kl is a sample mean of log p_student - log p_teacher over the student's tokens: it may come out
    # negative on a few dozen tokens, but it is finite, and not zero unless the teacher were the student.
    assert all(math.isfinite(m["teacher_kl"]) and abs(m["teacher_kl"]) > 1e-5 for m in distilled)
    assert f"loading {TEACHER} for" in log.read_text()  # the teacher came on demand, by its hub name
    trained = _metrics(tmp_path / "sl_loop")
    assert trained and all(m["train_mean_nll"] > 0 for m in trained if "train_mean_nll" in m)
    assert any("train_mean_nll" in m for m in trained)
    assert [m["step"] for m in _metrics(tmp_path / "rl_loop")] == [0, 1]
    chatted = [m["train_mean_nll"] for m in _metrics(tmp_path / "chat_sl") if "train_mean_nll" in m]
    assert len(chatted) == 2 and all(math.isfinite(x) and x > 0 for x in chatted)
