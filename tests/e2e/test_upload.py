"""`python -m tx.upload` against a real server: round trip (the upload loads on demand as `upload:NAME` and
its logprobs equal transformers on the uploaded directory), resume after a cut connection, isolation
between keys, bad uploads refused and never listed, delete, and an upload that survives a restart.

The CLI runs as a child process (it reads TINKER_BASE_URL / TINKER_API_KEY like the SDK); the server is
built the way `python -m tx.api` builds it (`parse_args`, `build_pool`, `build_catalog`, the upload store),
in-process on a loopback port, on a tiny base model. The uploaded model is the offline tiny Qwen3 (with its
BPE tokenizer) re-saved by transformers in several safetensors shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
import uvicorn
from tinker import types

from e2e.conftest import KEY
from e2e.tcp_proxy import CuttingProxy
from tx.db import owner_of
from tx.upload_store import UploadStore

pytestmark = pytest.mark.e2e
OTHER_KEY = "tml-someone-else"
MAX_UPLOAD = 20_000_000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 with its tokenizer, re-saved by transformers as sharded safetensors (index + shards)."""
    from transformers import AutoModelForCausalLM

    from tx.models.tiny import write_tiny_model

    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")
    out = tmp_path_factory.mktemp("sharded") / "model"
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(out, max_shard_size="150KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    assert len(list(out.glob("*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").is_file()
    return out


def serve(base_model: Path, data_dir: Path) -> tuple[str, Callable[[], None]]:
    """A server on `base_model` over `data_dir`, with --max-upload-gb 0.02; returns (url, stop)."""
    from tx.api.__main__ import build_catalog, build_pool, parse_args
    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.db import open_database
    from tx.engine.loop import Engine

    argv = ["--base-model", str(base_model), "--data-dir", str(data_dir), "--max-upload-gb", str(MAX_UPLOAD / 1e9)]
    args = parse_args([*argv, "--max-lora-rank", "8", "--max-lora-adapters", "2", "--max-seq-len", "128"])
    db = open_database(None, data_dir)
    uploads = UploadStore(data_dir / "uploads", int(args.max_upload_gb * 1e9))
    pool = build_pool(args)
    engine = Engine(db.queue, pool)
    engine.start()
    settings = Settings(data_dir=data_dir, max_upload_bytes=uploads.max_upload_bytes)
    app = create_app(settings, db, build_catalog(args, pool, uploads), uploads)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        engine.stop()
        pool.close()
        db.close()

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def server(hf_models, tmp_path_factory):
    """(url, data dir, stop) of a server on another tiny model, with a small --max-upload-gb."""
    data_dir = tmp_path_factory.mktemp("upload-data")
    url, stop = serve(hf_models()[0], data_dir)
    stopped: list[bool] = []

    def stop_once() -> None:
        if not stopped:
            stopped.append(True)
            stop()

    yield url, data_dir, stop_once
    stop_once()


def run_cli(url: str, *args: str, key: str = KEY) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tx.upload", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def listed(url: str, key: str = KEY) -> set[str]:
    with httpx.Client(base_url=url, headers={"X-API-Key": key}) as http:
        uploads = {u["base_model"] for u in http.get("/api/v1/uploads").json()["uploads"]}
        capabilities = {m["model_name"] for m in http.get("/api/v1/get_server_capabilities").json()["supported_models"]}
    assert uploads <= capabilities  # every upload is offered to its owner
    return uploads


def store(data_dir: Path) -> UploadStore:
    return UploadStore(data_dir / "uploads", MAX_UPLOAD)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "copy"))


def test_round_trip_stores_the_files_and_lists_them_for_their_owner_only(server, model_dir):
    url, data_dir, _ = server
    done = run_cli(url, str(model_dir), "--name", "tiny", "--chunk-mb", "0.05")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "upload:tiny"
    assert "upload:tiny" in listed(url) and "upload:tiny" not in listed(url, OTHER_KEY)
    stored = store(data_dir).find_upload(owner_of(KEY), "upload:tiny")
    assert stored is not None
    assert {p.name: digest(p) for p in model_dir.iterdir()} == {p.name: digest(p) for p in stored.iterdir()}
    assert store(data_dir).find_upload(owner_of(OTHER_KEY), "upload:tiny") is None
    again = run_cli(url, str(model_dir), "--name", "tiny")
    assert again.returncode == 1 and "already exists" in again.stderr


def test_another_key_gets_404_and_cannot_delete(server, model_dir):
    url, data_dir, _ = server
    assert run_cli(url, str(model_dir), "--name", "mine").returncode == 0
    with httpx.Client(base_url=url, headers={"X-API-Key": OTHER_KEY}) as http:
        assert http.get("/api/v1/uploads/mine").status_code == 404
        assert http.delete("/api/v1/uploads/mine").status_code == 404
        chunk = http.put(
            "/api/v1/uploads/mine/files/config.json",
            params={"offset": 0},
            content=b"{}",
            headers={"X-Chunk-Sha256": hashlib.sha256(b"{}").hexdigest()},
        )
        assert chunk.status_code == 404
    refused = run_cli(url, "--delete", "mine", key=OTHER_KEY)
    assert refused.returncode == 1 and "no upload named 'mine'" in refused.stderr
    assert "upload:mine" in listed(url)


def test_a_cut_connection_resumes_where_the_server_stopped(server, model_dir):
    url, data_dir, _ = server
    total = sum(p.stat().st_size for p in model_dir.iterdir())
    port = int(url.rsplit(":", 1)[1])
    cutter = CuttingProxy(port, cut_after=total // 2)
    cut = run_cli(cutter.url, str(model_dir), "--name", "resumed", "--chunk-mb", "0.05", "--retries", "0")
    cutter.close()
    assert cut.returncode != 0 and cutter.cuts == 1
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as http:
        partial = http.get("/api/v1/uploads/resumed").json()
    held = sum(partial["received"].values())
    assert partial["state"] == "partial" and 0 < held < total
    assert "upload:resumed" not in listed(url)
    assert store(data_dir).find_upload(owner_of(KEY), "upload:resumed") is None

    counter = CuttingProxy(port)
    done = run_cli(counter.url, str(model_dir), "--name", "resumed", "--chunk-mb", "0.05")
    counter.close()
    assert done.returncode == 0, done.stderr
    assert total - held < counter.sent < total - held + 60_000  # the rest, plus headers and the file list
    stored = store(data_dir).find_upload(owner_of(KEY), "upload:resumed")
    assert stored is not None and digest(stored / "config.json") == digest(model_dir / "config.json")


def test_a_connection_cut_mid_chunk_is_retried_in_the_same_run(server, model_dir):
    url, _, _ = server
    cutter = CuttingProxy(int(url.rsplit(":", 1)[1]), cut_after=200_000)
    done = run_cli(cutter.url, str(model_dir), "--name", "retried", "--chunk-mb", "0.05")
    cutter.close()
    assert done.returncode == 0, done.stderr
    assert cutter.cuts == 1 and "asking the server what it holds" in done.stderr
    assert "upload:retried" in listed(url)


def _truncate_a_shard(d: Path) -> None:
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])


def _mismatch_a_shape(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))


def _unsupported_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))


def _too_large(d: Path) -> None:
    with open(d / "notes.txt", "wb") as f:  # sparse: a real file of that size without the disk
        f.truncate(MAX_UPLOAD + 1)


def _broken_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text("{not json")


def _regex_decoder(d: Path) -> None:
    """A decoder pattern that backtracks just under the regex engine's limit: 0.1 s a token, GIL held."""
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    slow = {"type": "Replace", "pattern": {"Regex": "(.|.)*\\d"}, "content": "z"}
    tokenizer["decoder"] = {"type": "Sequence", "decoders": [slow, tokenizer["decoder"]]}
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize(
    "spoil,message",
    [
        (_truncate_a_shard, r"model-00002-of-\d+\.safetensors is truncated: tensor '.*' ends at data byte"),
        (_mismatch_a_shape, r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), expected"),
        (
            _unsupported_architecture,
            r"unsupported architecture \['MistralForCausalLM'\]; supported: .*LlamaForCausalLM",
        ),
        (_too_large, r"over this server's --max-upload-gb 0\.02"),
        (_broken_tokenizer, r"the tokenizer does not load with transformers"),
        (_regex_decoder, r"decoder replaces by regular expression"),
    ],
)
def test_a_bad_upload_is_refused_with_its_reason_and_never_listed(server, model_dir, tmp_path, spoil, message):
    url, data_dir, _ = server
    spoiled = copy_of(model_dir, tmp_path)
    spoil(spoiled)
    refused = run_cli(url, str(spoiled), "--name", "bad")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith("error: ")
    assert re.search(message, refused.stderr), refused.stderr
    assert str(data_dir) not in refused.stderr  # server paths never reach the client
    assert "upload:bad" not in listed(url)
    assert store(data_dir).find_upload(owner_of(KEY), "upload:bad") is None
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as http:
        assert http.get("/api/v1/uploads/bad").status_code == 404  # nothing partial kept either


def test_whatever_the_files_make_the_check_raise_refuses_the_upload(model_dir, tmp_path):
    """The client declares config.json at `begin`, but the file sent is what is checked: a file of `[]`
    raised AttributeError inside the check, which answered 500 and kept the staging directory."""
    from tx.api.upload_check import check_upload

    spoiled = copy_of(model_dir, tmp_path)
    for text in ("[]", "[" * 100_000 + "]" * 100_000):
        (spoiled / "config.json").write_text(text)
        with pytest.raises(ValueError) as refused:
            check_upload(spoiled)
        assert str(spoiled) not in str(refused.value)


def test_delete_removes_the_upload_and_its_files(server, model_dir):
    url, data_dir, _ = server
    assert run_cli(url, str(model_dir), "--name", "gone").returncode == 0
    stored = store(data_dir).find_upload(owner_of(KEY), "upload:gone")
    assert stored is not None and stored.is_dir()
    assert np.isfinite(logprobs_of(url, "upload:gone")).all()  # loaded on demand, so the server knows it
    deleted = run_cli(url, "--delete", "gone")
    assert deleted.returncode == 0 and deleted.stdout.strip() == "deleted upload:gone"
    assert not stored.exists() and "upload:gone" not in listed(url)
    assert store(data_dir).find_upload(owner_of(KEY), "upload:gone") is None
    with pytest.raises(tinker.TinkerError, match="no upload by that name"):
        logprobs_of(url, "upload:gone")
    assert run_cli(url, "--delete", "gone").returncode == 1


def reference_logprobs(model_dir: Path, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    torch_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = torch_model(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


TOKENS = [5, 17, 42, 99, 3, 250, 7, 64]


def logprobs_of(url: str, base_model: str, key: str = KEY) -> np.ndarray:
    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        sampler = service.create_sampling_client(base_model=base_model)
        return np.array(sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:], np.float64)


def test_the_examples_train_an_upload_with_the_tokenizer_named_on_their_command_line(server, model_dir):
    """An upload whose files record no hub name gives clients the tokenizer id `upload:NAME`, which no client
    resolves: the example says to pass `--tokenizer` (it spent a minute retrying the hub, then crashed)."""
    url, _, _ = server
    assert run_cli(url, str(model_dir), "--name", "for-examples").returncode == 0
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    example = [sys.executable, str(REPO / "examples" / "sl_loop.py"), "--base-model", "upload:for-examples"]
    unnamed = subprocess.run([*example, "--steps", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert unnamed.returncode == 1 and "pass --tokenizer DIR" in unnamed.stderr, unnamed.stderr[-2000:]
    named = [*example, "--steps", "2", "--tokenizer", str(model_dir)]
    trained = subprocess.run(named, env=env, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0 and trained.stdout.count("loss/token") == 2, trained.stderr[-2000:]


def test_an_upload_survives_a_restart_and_serves_transformers_logprobs(server, model_dir, hf_models):
    """Last in the module: it stops the shared server and starts another on the same data directory, which
    loads the upload on demand by its name."""
    url, data_dir, stop = server
    assert run_cli(url, str(model_dir), "--name", "kept").returncode == 0
    stop()
    url, stop_again = serve(hf_models()[0], data_dir)
    try:
        assert "upload:kept" in listed(url) and "upload:kept" not in listed(url, OTHER_KEY)
        np.testing.assert_allclose(logprobs_of(url, "upload:kept"), reference_logprobs(model_dir, TOKENS), atol=1e-4)
        with pytest.raises(tinker.TinkerError, match="no upload by that name"):
            logprobs_of(url, "upload:kept", key=OTHER_KEY)
    finally:
        stop_again()
