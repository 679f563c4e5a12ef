"""`python -m tx.api`: options, key loading, and the ready announcement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tx.api import __main__ as cli
from tx.engine.build import resolve_dtype
from tx.engine.multihost import Cluster
from tx.tuning import for_backend


def test_help_lists_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "tx.api", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--base-model", "--host", "--port", "--data-dir", "--database-url", "--max-lora-adapters",
                 "--max-lora-rank", "--tensor-parallel-size", "--fsdp-size", "--expert-parallel-size", "--dtype",
                 "--train-micro-batch-tokens",
                 "--api-key", "--api-keys-file", "--prompt-cache-mb", "--role", "--allow-models",
                 "--memory-budget-gb", "--max-upload-gb", "--max-runs", "--max-run-state-gb",
                 "--decode-cache-gb"):  # fmt: skip
        assert flag in out


def test_defaults_and_repeatable_keys(tmp_path: Path) -> None:
    args = cli.parse_args(["--base-model", "Qwen/Qwen3-0.6B", "--api-key", "tml-a", "--api-key", "tml-b"])
    assert (args.port, args.data_dir, args.host, args.dtype) == (8000, "./smolgym-data", "127.0.0.1", "auto")
    # auto: float32 on CPU (no bfloat16 arithmetic there), bfloat16 on accelerators; None keeps the checkpoint's
    cpu, gpu = for_backend("cpu"), for_backend("gpu")
    assert (resolve_dtype("auto", cpu), resolve_dtype(None, cpu), resolve_dtype("bfloat16", cpu)) == (
        "float32", None, "bfloat16",
    )  # fmt: skip
    assert (resolve_dtype("auto", gpu), resolve_dtype("float32", gpu)) == ("bfloat16", "float32")
    assert args.prompt_cache_mb == 256
    variants = cli.parse_args(["--base-model", "Qwen/Qwen3.5-9B-Base:peft:262144", "--base-model", "./m:peft:9"])
    assert variants.base_model == ["Qwen/Qwen3.5-9B-Base", "./m:peft:9"]  # a Tinker variant id preloads its model
    with pytest.raises(SystemExit):
        cli.parse_args(["--base-model", "m", "--prompt-cache-mb", "-1"])
    keys_file = tmp_path / "keys"
    keys_file.write_text("tml-c  # laptop\n\n# comment\ntml-d\n")
    assert cli.load_api_keys(args.api_key, str(keys_file)) == {"tml-a", "tml-b", "tml-c", "tml-d"}


def test_split_roles_need_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    """SQLite's write lock is in-process: separate API and engine processes on one SQLite file are refused."""
    assert cli.parse_args([]).role == "all"
    for role in ("api", "engine"):
        for url in ([], ["--database-url", "sqlite:////tmp/x.db"]):
            with pytest.raises(SystemExit):
                cli.parse_args(["--role", role, *url])
            assert f"--role {role} needs a shared Postgres --database-url" in capsys.readouterr().err
    args = cli.parse_args(["--role", "api", "--database-url", "postgresql://db/smolgym"])
    assert args.role == "api" and cli.parse_args(["--role", "engine", "--database-url", "postgres://db/x"])


def test_ready_announcement(capsys: pytest.CaptureFixture[str]) -> None:
    cli._announce_when_ready(SimpleNamespace(started=True, should_exit=False), "0.0.0.0", 8123, "tml-x")  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "export TINKER_API_KEY=tml-x" in out and "TINKER_BASE_URL=http://localhost:8123" in out
    assert out.strip().endswith("SmolGym ready on http://0.0.0.0:8123")


def test_bad_base_model_is_a_one_line_error(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tx.api", "--base-model", str(tmp_path / "no" / "model"), "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "error: no model directory at" in proc.stderr and "Traceback" not in proc.stderr


def test_a_database_that_is_not_up_is_a_one_line_error(tmp_path: Path) -> None:
    """A Postgres not started yet (a deployment starting it beside SmolGym) was a 40-line SQLAlchemy traceback."""
    import socket

    from tx.api.__main__ import main

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"postgresql://postgres@127.0.0.1:{sock.getsockname()[1]}/smolgym"
    with pytest.raises(SystemExit, match="cannot open the database: connection failed.*refused"):
        main(["--base-model", str(tmp_path), "--database-url", url, "--role", "api", "--data-dir", str(tmp_path)])
    bad = "postgresql://u:secret@127.0.0.1:notaport/x"
    with pytest.raises(SystemExit, match="--database-url is not a database URL") as refused:
        main(["--base-model", str(tmp_path), "--database-url", bad, "--role", "api", "--data-dir", str(tmp_path)])
    assert "secret" not in str(refused.value)


def test_mesh_sizes_reach_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.parse_args(["--expert-parallel-size", "4", "--fsdp-size", "2", "--tensor-parallel-size", "1"])
    config = cli.engine_config(args)
    assert (config.expert_parallel_size, config.fsdp_size, config.tensor_parallel_size) == (4, 2, 1)
    assert cli.engine_config(cli.parse_args([])).expert_parallel_size == 1
    assert cli.engine_config(cli.parse_args([])).sampler.cache_limit_bytes is None  # follow the free memory
    assert cli.engine_config(cli.parse_args(["--decode-cache-gb", "2.5"])).sampler.cache_limit_bytes == 2_500_000_000
    for flag in ("--expert-parallel-size", "--fsdp-size", "--tensor-parallel-size"):
        with pytest.raises(SystemExit):
            cli.parse_args([flag, "0"])
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--num-processes", "2", "--process-id", "1"], "need --coordinator"),
        (["--coordinator", "hostonly", "--num-processes", "2", "--process-id", "0"], "HOST:PORT or auto"),
        (["--coordinator", "h:1", "--num-processes", "2"], "needs --num-processes and --process-id"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, 2)"),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "--num-processes must be >= 1"),
        (["--coordinator", "auto", "--follower-timeout", "0"], "--follower-timeout must be > 0"),
        (["--max-run-state-gb", "0"], "--max-run-state-gb must be > 0 and finite, got 0.0"),
        (["--max-run-state-gb", "nan"], "--max-run-state-gb must be > 0 and finite, got nan"),
        (["--decode-cache-gb", "-1"], "--decode-cache-gb must be > 0 and finite, got -1.0"),
        (["--open-session-timeout", "0"], "--open-session-timeout must be > 0 and finite, got 0.0"),
        (["--session-timeout", "inf"], "--session-timeout must be > 0 and finite, got inf"),
        (["--max-runs-per-key", "0"], "--max-runs-per-key must be >= 1, got 0"),
    ],
)
def test_cluster_flags_are_checked_at_start(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--base-model", "m", *argv])
    assert names in capsys.readouterr().err


def test_cluster_flags_from_the_environment(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    flags = (("COORDINATOR", "10.0.0.1:5000"), ("NUM_PROCESSES", "4"), ("PROCESS_ID", "3"), ("PLAN_PORT", "7001"))
    for name, value in (*flags, ("FOLLOWER_TIMEOUT", "12.5")):
        monkeypatch.setenv(f"SMOLGYM_{name}", value)
    args = cli.parse_args(["--base-model", "m"])
    assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.1:5000", 4, 3)
    assert (args.plan_port, args.follower_timeout) == (7001, 12.5)
    assert cli.cluster_of(args) == Cluster("10.0.0.1:5000", 4, 3)
    for refused, why in ((["--base-model", "m", "--role", "api"], "--role api runs no engine"), ([], "--base-model")):
        with pytest.raises(SystemExit):
            cli.parse_args(refused)
        assert why in capsys.readouterr().err


def test_who_may_load_what_follows_the_listening_address(tmp_path: Path) -> None:
    """No --allow-models: any model on loopback, only the --base-model list (and uploads) on another address;
    given globs, exactly those."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}'
    )

    def allowed(*flags: str) -> tuple[str, ...] | None:
        return cli.build_catalog(cli.parse_args(["--base-model", str(model), *flags]), None).rules.allow

    assert allowed() is None and allowed("--host", "127.0.0.1") is None
    assert allowed("--host", "0.0.0.0") == (str(model),)
    assert allowed("--host", "0.0.0.0", "--allow-models", "Qwen/*", "meta-llama/*") == ("Qwen/*", "meta-llama/*")


def test_a_taken_port_is_refused_before_the_model_loads(tmp_path) -> None:
    """uvicorn found the address taken only after the model had loaded (minutes for a large one)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--base-model", str(tmp_path / "never" / "loaded"), "--data-dir", str(tmp_path), "--port", str(port)]
        proc = subprocess.run([sys.executable, "-m", "tx.api", "--host", "127.0.0.1", *argv],
            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
