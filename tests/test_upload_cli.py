"""`python -m tx.upload` refuses bad invocations with one clear line, before it talks to any server."""

from __future__ import annotations

import json
import socket

import pytest

from tx import upload


def run(monkeypatch, capsys, argv: list[str], key: str | None = "tml-x", url: str | None = None) -> tuple[int, str]:
    """(exit status, stderr) of the CLI."""
    if key is None:
        monkeypatch.delenv("TINKER_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TINKER_API_KEY", key)
    if url is not None:
        monkeypatch.setenv("TINKER_BASE_URL", url)
    with pytest.raises(SystemExit) as exit_:
        upload.main(argv)
    assert isinstance(exit_.value.code, int)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "give a model directory with --name, or --delete NAME, or --list"),
        (["some/dir"], "--name is required with a model directory"),
        (["some/dir", "--name", "x", "--delete", "y"], "give a model directory"),
        (["some/dir", "--name", "x", "--chunk-mb", "0"], "--chunk-mb must be > 0"),
    ],
)
def test_bad_arguments_are_usage_errors(monkeypatch, capsys, argv, message):
    code, err = run(monkeypatch, capsys, argv)
    assert code == 2 and message in err


def test_a_missing_key_or_directory_or_server_is_one_line(monkeypatch, capsys, tmp_path):
    assert run(monkeypatch, capsys, ["--list"], key=None) == (
        1,
        "error: set TINKER_API_KEY to a key the server accepts\n",
    )
    code, err = run(monkeypatch, capsys, [str(tmp_path / "nothing"), "--name", "x"])
    assert code == 1 and "is not a directory" in err
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "bad name.safetensors").write_bytes(b"")
    code, err = run(monkeypatch, capsys, [str(tmp_path), "--name", "x"])
    assert code == 1 and "file names the server will refuse: ['bad name.safetensors']" in err
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code, err = run(monkeypatch, capsys, ["--list"], url=url)
    assert code == 1 and "cannot reach the server" in err
