"""`python -m tx.upload DIR --name NAME`: send a Hugging Face model directory to a SmolGym server.

Reads `TINKER_BASE_URL` (default http://localhost:8000) and `TINKER_API_KEY` like the tinker SDK and talks
to the server over HTTP only (`tx.api.routes_upload`). The files a model needs (config and other JSON,
safetensors, tokenizer files) are hashed, declared with their sizes and sha256, then sent in chunks, each
with its own sha256, from the offset the server says it holds: a dropped connection is retried from
there, and running the same command again resumes an upload that was cut off. The server validates the
whole directory before registering it. The last line printed is the base-model string to use
(`upload:NAME`). `--delete NAME` removes an upload, `--list` shows yours.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import httpx
from tqdm import tqdm

from tx.names import is_valid_name

MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja")
HASH_READ = 8 << 20
TIMEOUT = httpx.Timeout(60.0, read=1800.0)  # finish hashes and validates the whole model before answering
TRANSIENT = (408, 416, 423, 429)  # and 5xx: retried; any other 4xx is the server's final answer


class Refused(Exception):
    """The server refused a request with a 4xx; its detail is the message."""


def model_files(model_dir: Path) -> list[Path]:
    """The files of `model_dir` a model needs; a needed file with a name the server refuses is an error."""
    picked = [p for p in sorted(model_dir.iterdir()) if p.is_file() and _wanted(p.name)]
    bad = [p.name for p in picked if not is_valid_name(p.name)]
    if bad:
        fail(f"file names the server will refuse: {bad}")
    if not any(p.name == "config.json" for p in picked):
        fail(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    return picked


def _wanted(name: str) -> bool:
    return not name.startswith(".") and any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILES)


def sha256_file(path: Path, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_READ):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


class Uploader:
    """One server connection; every request retried across dropped connections, `retries` times in a row."""

    def __init__(self, base_url: str, api_key: str, retries: int, wait_s: float = 1.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers={"X-API-Key": api_key}, timeout=TIMEOUT)
        self.retries, self.wait_s = retries, wait_s

    def call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        response = self.http.request(method, url, **kwargs)
        if 400 <= response.status_code < 500 and response.status_code not in TRANSIENT:
            raise Refused(_detail(response))
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        return reply

    def retrying(self, action: Callable[[], Any], what: str) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return action()
            except (httpx.TransportError, httpx.HTTPStatusError) as err:
                if attempt == self.retries:
                    fail(f"{what} failed after {attempt + 1} tries ({_reason(err)})")
                tqdm.write(f"{what}: {_reason(err)}; resuming in {self.wait_s * 2**attempt:g} s", file=sys.stderr)
                time.sleep(self.wait_s * 2**attempt)
        raise AssertionError("unreachable")


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail"))
    except ValueError:
        return response.text[:500]


def _reason(err: Exception) -> str:
    if isinstance(err, httpx.HTTPStatusError):
        return f"HTTP {err.response.status_code}: {_detail(err.response)}"
    return type(err).__name__


def upload(client: Uploader, model_dir: Path, name: str, chunk_bytes: int) -> dict[str, Any]:
    files = model_files(model_dir)
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing") as bar:
        declared = [{"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p, bar)} for p in files]
    config = json.loads((model_dir / "config.json").read_text())
    begin = {"files": declared, "config": config}
    state = client.retrying(lambda: client.call("POST", f"/api/v1/uploads/{name}", json=begin), "starting")
    chunk_bytes = min(chunk_bytes, int(state["chunk_bytes"]))
    with tqdm(total=total, initial=sum(state["received"].values()), unit="B", unit_scale=True, desc=name) as bar:
        for path in files:
            send_file(client, name, path, chunk_bytes, bar)
    return dict(client.retrying(lambda: client.call("POST", f"/api/v1/uploads/{name}/finish"), "validating"))


def send_file(client: Uploader, name: str, path: Path, chunk_bytes: int, bar: tqdm) -> None:
    """Send `path` from the offset the server holds, one checked chunk per request; after a dropped
    connection the server is asked again where the file stands (`client.retries` failures in a row at most)."""
    size, failures = path.stat().st_size, 0
    held = client.retrying(lambda: held_bytes(client, name, path.name), "status")
    with open(path, "rb") as f:
        while held < size:
            f.seek(held)
            chunk = f.read(min(chunk_bytes, size - held))
            try:
                new_held = put_chunk(client, name, path.name, held, chunk)
                failures = 0
            except (httpx.TransportError, httpx.HTTPStatusError) as err:
                failures += 1
                if failures > client.retries:
                    fail(f"sending {path.name} failed {failures} times ({_reason(err)})")
                tqdm.write(f"{path.name}: {_reason(err)}; asking the server what it holds", file=sys.stderr)
                time.sleep(client.wait_s * 2 ** (failures - 1))
                new_held = client.retrying(lambda: held_bytes(client, name, path.name), "resuming")
            bar.update(new_held - held)
            held = new_held


def put_chunk(client: Uploader, name: str, file: str, offset: int, chunk: bytes) -> int:
    headers = {"X-Chunk-Sha256": hashlib.sha256(chunk).hexdigest()}
    url = f"/api/v1/uploads/{name}/files/{file}"
    return int(client.call("PUT", url, params={"offset": offset}, content=chunk, headers=headers)["received"])


def held_bytes(client: Uploader, name: str, file: str) -> int:
    state = client.call("GET", f"/api/v1/uploads/{name}")
    received = state.get("received") or {}
    if file not in received:
        raise Refused(f"the server's upload {name!r} has no file {file!r}")
    return int(received[file])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tx.upload",
        description="Send a Hugging Face model directory to a SmolGym server, resumably; the last line printed is "
        "the base-model string to use (upload:NAME).",
        epilog="Reads TINKER_BASE_URL (default http://localhost:8000) and TINKER_API_KEY, like the tinker SDK.",
    )
    p.add_argument("model_dir", nargs="?", help="Hugging Face model directory (config.json, tokenizer, safetensors)")
    p.add_argument("--name", help="the upload's name: it is served as base model upload:NAME")
    p.add_argument("--delete", metavar="NAME", help="delete your upload NAME (complete or partial)")
    p.add_argument("--list", action="store_true", help="list your uploads")
    p.add_argument("--chunk-mb", type=float, default=8.0, help="MiB per request (default 8, the server's limit)")
    p.add_argument("--retries", type=int, default=8, help="tries per request after a dropped connection (default 8)")
    args = p.parse_args(argv)
    if sum([args.delete is not None, args.list, args.model_dir is not None]) != 1:
        p.error("give a model directory with --name, or --delete NAME, or --list")
    if args.model_dir is not None and not args.name:
        p.error("--name is required with a model directory")
    if not args.chunk_mb > 0 or args.retries < 0:
        p.error("--chunk-mb must be > 0 and --retries >= 0")
    return args


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    api_key = os.environ.get("TINKER_API_KEY") or fail("set TINKER_API_KEY to a key the server accepts")
    client = Uploader(os.environ.get("TINKER_BASE_URL", "http://localhost:8000"), api_key, args.retries)
    try:
        if args.list:
            for item in client.call("GET", "/api/v1/uploads")["uploads"]:
                print(f"{item['base_model']}\t{item['architecture']}\t{item['size_bytes']} bytes")
        elif args.delete is not None:
            client.call("DELETE", f"/api/v1/uploads/{args.delete}")
            print(f"deleted upload:{args.delete}")
        else:
            model_dir = Path(args.model_dir)
            if not model_dir.is_dir():
                fail(f"{model_dir} is not a directory")
            info = upload(client, model_dir, args.name, int(args.chunk_mb * (1 << 20)))
            print(f"uploaded {info['architecture']}, {info['size_bytes']} bytes in {info['files']} files; base model:")
            print(info["base_model"])
    except Refused as err:
        fail(str(err))
    except httpx.TransportError as err:
        fail(f"cannot reach the server ({type(err).__name__}); is TINKER_BASE_URL right?")


if __name__ == "__main__":
    main()
