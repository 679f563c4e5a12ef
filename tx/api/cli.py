"""The command line of `python -m tx.api`: every flag with its help text and the checks between flags, and
the API keys it names (`--api-key`, `--api-keys-file`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tx.api.cluster import add_cluster_args, check_cluster_args
from tx.api.context import DEFAULT_MAX_UPLOAD_GB
from tx.db.connect import is_postgres_url
from tx.models.catalog import split_variant

ROLES = ("all", "api", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tx.api", description="SmolGym: the Tinker training API on your machine."
    )
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        help="Hugging Face model id or local directory of a base model to load at start (repeatable; a Tinker "
        "variant id, org/model:peft:N, names its hub model); clients may name other models too, loaded on demand "
        "as --allow-models permits",
    )
    p.add_argument(
        "--allow-models",
        nargs="+",
        metavar="PATTERN",
        default=None,
        help="globs over the model strings clients may load on demand (e.g. 'Qwen/*' '/models/*'); default: any "
        "model when --host is loopback, otherwise only the --base-model list. Uploads are always allowed to "
        "their owner; a path into --data-dir never is (tenants' checkpoints live there)",
    )
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="device memory for loaded models; loading past it unloads idle models, least recently used first "
        "(default: 80%% of the accelerators' memory, or half the host's memory on CPU)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--data-dir",
        default="./smolgym-data",
        help="database, checkpoints, compile cache and measured tuning (default ./smolgym-data)",
    )
    p.add_argument("--database-url", default=None, help="SQLAlchemy/Postgres URL; default: SQLite file in --data-dir")
    p.add_argument(
        "--role",
        default="all",
        choices=ROLES,
        help="all (default): HTTP and engine in this process; api: HTTP only; engine: the engine only. The split "
        "roles share one Postgres --database-url and one --data-dir; run exactly one engine (docs/deploy.md)",
    )
    p.add_argument(
        "--max-lora-adapters",
        type=int,
        default=8,
        help="LoRA adapter slots on the device (default 8); runs and sampler snapshots beyond them are paged to "
        "host memory; sampling reads all slots but one at most, so training always has one",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=256,
        help="training runs per server, on the device or paged out to host memory (default 256)",
    )
    p.add_argument(
        "--max-runs-per-key",
        type=int,
        default=128,
        help="training runs one API key may hold at once, of --max-runs (default 128), so one tenant cannot "
        "take every run the server has",
    )
    p.add_argument(
        "--max-run-state-gb",
        type=float,
        default=None,
        help="memory all LoRA runs' state (adapter, gradients, AdamW moments) may take together, on the device "
        "or paged out to host memory; a new run past it is refused, and sampler snapshots paged out to host "
        "memory keep to what the runs leave, oldest dropped first (default: a quarter of the host's memory)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=128,
        help="largest LoRA rank a run may ask for (default 128, the cookbook's distillation rank); device memory "
        "and adapter compute follow the ranks of the adapters in use, not this limit",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per tensor-parallel group (default 1)")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        help="devices a mixture-of-experts block's experts are split over, each holding a share of every block's "
        "experts; batch rows are split over them too (default 1)",
    )
    p.add_argument(
        "--fsdp-size", type=int, default=1, help="devices the weights are sharded over with FSDP (default 1)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="weight and compute dtype of the base model; auto (default) = bfloat16 on GPU/TPU, float32 on CPU, "
        "where bfloat16 has no hardware support and runs several times slower",
    )
    p.add_argument(
        "--train-micro-batch-tokens",
        type=int,
        default=8192,
        help="tokens per training micro-batch; bounds memory (default 8192)",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="recompute each layer's activations in the backward pass (gradient checkpointing): less memory, "
        "about a third more compute",
    )
    p.add_argument(
        "--max-seq-len", type=int, default=4096, help="longest prompt + generation or training sequence (default 4096)"
    )
    p.add_argument("--decode-rows", type=int, default=64, help="sampling rows decoded together at most (default 64)")
    p.add_argument(
        "--decode-cache-gb",
        type=float,
        default=None,
        help="the decode cache's size at most: rows past it wait, a request with more samples is split (default: "
        "45%% of the memory free when rows are admitted; with several processes, no limit unless given)",
    )
    p.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=256,
        help="MiB for prefilled prompts kept for later requests with the same prompt (default 256; 0 = off)",
    )
    p.add_argument(
        "--api-key", action="append", default=[], help="accept only this key (repeatable); default: any tml- key"
    )
    p.add_argument("--api-keys-file", default=None, help="file with one accepted API key per line ('#' comments)")
    p.add_argument(
        "--session-timeout",
        type=float,
        default=180.0,
        help="seconds without a heartbeat (the SDK sends one every 10 s) before a session expires and its runs "
        "are unloaded, giving their adapter slots back (default 180)",
    )
    p.add_argument(
        "--open-session-timeout",
        type=float,
        default=86400.0,
        help="seconds a run made without a session (tinker SDK 0.1-0.2, no heartbeats) may go without finishing a "
        "request before it is unloaded like an expired session's (default 86400: a day)",
    )
    p.add_argument(
        "--max-upload-gb",
        type=float,
        default=DEFAULT_MAX_UPLOAD_GB,
        help=f"largest base model one `python -m tx.upload` may send, in GB (default {DEFAULT_MAX_UPLOAD_GB:g})",
    )
    p.add_argument("--log-level", default="info", help="logging level (default info)")
    add_cluster_args(p)
    args = p.parse_args(argv)
    check_cluster_args(p, args)
    args.base_model = [split_variant(name)[0] for name in args.base_model]  # clients' variants are views of it
    for flag in ("tensor_parallel_size", "fsdp_size", "expert_parallel_size", "max_runs_per_key"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prompt_cache_mb < 0:
        p.error(f"--prompt-cache-mb must be >= 0, got {args.prompt_cache_mb}")
    if not args.max_upload_gb > 0:
        p.error(f"--max-upload-gb must be > 0, got {args.max_upload_gb}")
    if args.memory_budget_gb is not None and args.memory_budget_gb <= 0:
        p.error(f"--memory-budget-gb must be > 0, got {args.memory_budget_gb}")
    for flag in ("max_run_state_gb", "decode_cache_gb", "open_session_timeout", "session_timeout"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < 1e9:
            p.error(f"--{flag.replace('_', '-')} must be > 0 and finite, got {value}")
    if args.role != "all" and not is_postgres_url(args.database_url):
        p.error(
            f"--role {args.role} needs a shared Postgres --database-url (postgresql://...): SQLite's write lock "
            "lives inside one process, so separate API and engine processes cannot share a SQLite file"
        )
    return args


def load_api_keys(keys: list[str], keys_file: str | None) -> frozenset[str]:
    found = set(keys)
    if keys_file:
        for line in Path(keys_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                found.add(line)
    return frozenset(found)
