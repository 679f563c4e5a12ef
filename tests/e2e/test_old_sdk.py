"""An older tinker SDK (0.16.1: JSON everywhere, no client/config, /forward) against the real server.

The SDK lives in its own interpreter (SMOLGYM_TINKER016_PYTHON, default /root/venvs/tinker016/bin/python);
the test is skipped where it does not exist.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

OLD_PYTHON = Path(os.environ.get("SMOLGYM_TINKER016_PYTHON", "/root/venvs/tinker016/bin/python"))
SCRIPT = Path(__file__).with_name("old_sdk_loop.py")


@pytest.mark.skipif(not OLD_PYTHON.exists(), reason=f"no tinker 0.16 interpreter at {OLD_PYTHON}")
@pytest.mark.parametrize("live", ["sqlite"], indirect=True)  # the SDK version does not depend on the queue
def test_sdk_016_sl_loop_sampling_and_resume(live):
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": ""}
    proc = subprocess.run(
        [str(OLD_PYTHON), str(SCRIPT), live.url, live.base_model],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["losses"][-1] < seen["losses"][0], seen["losses"]
    assert len(seen["samples"]) == 2 and all(len(s) >= 1 for s in seen["samples"])
    assert seen["prompt_logprobs"][0] is None and len(seen["prompt_logprobs"]) == 3
    assert seen["state"].startswith("tinker://") and seen["state"].endswith("/weights/old-sdk-state")
    assert seen["resumed_model_id"].count(":train:") == 1
