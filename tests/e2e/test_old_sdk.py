"""Older tinker SDKs against the real server: 0.16.1 (JSON everywhere, no client/config, /forward) and
0.2.2 (before sessions: create_model without a session_id, no seq_ids, samples name their weights).

Each SDK lives in its own interpreter (SMOLGYM_TINKER016_PYTHON / SMOLGYM_TINKER022_PYTHON, defaults under
/root/venvs; `.ci/run` builds both). A test is skipped where its interpreter does not exist, except under
CI, where that is a failure.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

pytestmark = pytest.mark.e2e

OLD_PYTHONS = {
    version: Path(os.environ.get(f"SMOLGYM_TINKER{tag}_PYTHON", f"/root/venvs/tinker{tag}/bin/python"))
    for version, tag in (("0.16.1", "016"), ("0.2.2", "022"))
}
SCRIPT = Path(__file__).with_name("old_sdk_loop.py")


OLD_KEY = "tml-old-sdk"  # the key old_sdk_loop.py uses
# The checkpoint types an SDK's listing of the key's checkpoints returns (null where it has no listing).
LIST_TYPES = f"""
import json, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key={OLD_KEY!r})
rest = service.create_rest_client() if hasattr(service, "create_rest_client") else None
if rest is None or not hasattr(rest, "list_user_checkpoints"):
    print("null")
else:
    print(json.dumps(sorted({{c.checkpoint_type for c in rest.list_user_checkpoints().result().checkpoints}})))
"""
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # its datum


@pytest.mark.parametrize("version", list(OLD_PYTHONS))
@pytest.mark.parametrize("live", ["sqlite"], indirect=True)  # the SDK version does not depend on the queue
def test_old_sdk_sl_loop_sampling_and_resume(live, version):
    python = OLD_PYTHONS[version]
    if not python.exists() and not os.environ.get("CI"):
        pytest.skip(f"no tinker {version} interpreter at {python}")
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": ""}
    proc = subprocess.run(
        [str(python), str(SCRIPT), live.url, live.base_model],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = seen["losses"]
    # A fresh adapter is the base model: the first loss is the transformers model's cross-entropy.
    with torch.no_grad():
        logits = live.torch_model(torch.tensor([TOKENS[:-1]])).logits[0]
    reference = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None]).sum().item()
    np.testing.assert_allclose(losses[0], reference, rtol=1e-4)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    # after the fourth step (Adam at lr 1e-2 bounces there on this datum: 24.4 -> 29.6, then 15.6)
    assert seen["forward"] < losses[0] and abs(seen["forward"] - losses[-1]) > 1e-3, (losses, seen["forward"])
    # The recorded forward loss is that of the weights the old SDK saved: the current SDK reads them back.
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(TOKENS[1:], np.int64), "weights": np.ones(7, np.float32)},
    )
    with tinker.ServiceClient(base_url=live.url, api_key=OLD_KEY) as service:
        restored = service.create_training_client_from_state(seen["state"]).result()
        again = restored.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        restored.save_weights_external("for-new-sdks").result()  # a type SDKs before 0.28 cannot read
    np.testing.assert_allclose(again, seen["forward"], rtol=1e-5)
    listed = subprocess.run([str(python), "-c", LIST_TYPES, live.url], capture_output=True, text=True, timeout=120,
                            env=env, check=False)  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-3000:]  # one external entry failed the whole listing
    types_seen = json.loads(listed.stdout.strip().splitlines()[-1])
    assert types_seen is None or "training" in types_seen and "external" not in types_seen, types_seen
    assert len(seen["samples"]) == 2 and all(len(s) >= 1 for s in seen["samples"])
    assert seen["prompt_logprobs"][0] is None and len(seen["prompt_logprobs"]) == 3
    assert seen["state"].startswith("tinker://") and seen["state"].endswith("/weights/old-sdk-state")
    assert seen["resumed_model_id"].count(":train:") == 1
