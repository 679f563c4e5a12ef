"""`python -m tx.api`: start SmolGym (database, engine thread, HTTP server), in one process or split by role.

`--role all` (default): open the database in the data directory (or `--database-url`), take the engine
lease (one engine per data directory and database, `tx.db.lease`), settle work left over from a previous
run (`recover`: what was running fails, what was queued runs unless it needed the dead process's memory,
`tx.engine.restart`), build the model pool (`tx.engine.pool.ModelPool`) and preload every `--base-model`
into it (each through `tx.engine.build_runner`), start the engine loop, then serve HTTP. Other models load
on demand, as `--allow-models` and `--memory-budget-gb` permit. When the server is listening it prints
how to point the `tinker` SDK at it and the line "SmolGym ready on http://HOST:PORT".

Split roles share one Postgres `--database-url` and one data directory (uploads, checkpoints):
`--role engine` does the recovery, the pool and the engine loop, no HTTP, and prints "SmolGym engine
ready"; `--role api` serves HTTP only. An API server never fails leftover work (the engine of another
process may be running it) and starts no engine: it describes models from their `config.json` through the
catalog, which locates each `--base-model` as the engine does, so both name it by the same directory.
NOTIFY carries new work to the engine and finished futures back to every API server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from tx.api.app import create_app
from tx.api.cluster import (
    NO_LOADS,
    add_cluster_args,
    check_cluster_args,
    cluster_of,
    join,
    pin_hash_seed,
    run_follower,
    watch_followers,
)
from tx.api.context import DEFAULT_MAX_UPLOAD_GB, Settings
from tx.api.models import ModelCatalog, ModelRules, default_allow
from tx.api.paths import checkpoints_root
from tx.db import Database, open_database
from tx.db.connect import is_postgres_url
from tx.db.lease import EngineBusy, EngineLease, take_engine_lease
from tx.protocol import LostState, RequestError
from tx.upload_store import GB, UploadStore

if TYPE_CHECKING:
    from tx.engine.loop import Engine
    from tx.engine.pool import ModelPool

log = logging.getLogger("tx.api")
ROLES = ("all", "api", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tx.api", description="SmolGym: the Tinker training API on your machine."
    )
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        help="Hugging Face model id or local directory of a base model to load at start (repeatable); clients may "
        "name other models too, loaded on demand as --allow-models permits",
    )
    p.add_argument(
        "--allow-models",
        nargs="+",
        metavar="PATTERN",
        default=None,
        help="globs over the model strings clients may load on demand (e.g. 'Qwen/*' '/models/*'); default: any "
        "model when --host is loopback, otherwise only the --base-model list. Uploads are always allowed to "
        "their owner",
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
        "--max-upload-gb",
        type=float,
        default=DEFAULT_MAX_UPLOAD_GB,
        help=f"largest base model one `python -m tx.upload` may send, in GB (default {DEFAULT_MAX_UPLOAD_GB:g})",
    )
    p.add_argument("--log-level", default="info", help="logging level (default info)")
    add_cluster_args(p)
    args = p.parse_args(argv)
    check_cluster_args(p, args)
    for flag in ("tensor_parallel_size", "fsdp_size", "expert_parallel_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prompt_cache_mb < 0:
        p.error(f"--prompt-cache-mb must be >= 0, got {args.prompt_cache_mb}")
    if not args.max_upload_gb > 0:
        p.error(f"--max-upload-gb must be > 0, got {args.max_upload_gb}")
    if args.memory_budget_gb is not None and args.memory_budget_gb <= 0:
        p.error(f"--memory-budget-gb must be > 0, got {args.memory_budget_gb}")
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


def engine_config(args: argparse.Namespace) -> Any:
    """The CLI flags as one `tx.engine.EngineConfig`, the same for every model the pool loads (which sets
    `base_model`). Imported here: JAX loads with the engine, not with the CLI."""
    from tx.engine.config import AdapterConfig, EngineConfig, TrainerConfig
    from tx.engine.sampler import SamplerConfig

    return EngineConfig(
        data_dir=Path(args.data_dir),
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        fsdp_size=args.fsdp_size,
        expert_parallel_size=args.expert_parallel_size,
        adapters=AdapterConfig(args.max_lora_adapters, args.max_lora_rank, args.max_runs),
        trainer=TrainerConfig(args.train_micro_batch_tokens, args.remat),
        sampler=SamplerConfig(
            max_rows=args.decode_rows, max_seq_len=args.max_seq_len, prompt_cache_bytes=args.prompt_cache_mb << 20
        ),
    )


def build_pool(args: argparse.Namespace) -> ModelPool:
    """THE ENGINE FACTORY: the one place the server builds the JAX engine. Each model the pool loads is
    one `tx.engine.build_runner(config)` with the flags' `EngineConfig`."""
    try:
        from tx.engine import build_runner
        from tx.engine.build import estimate_bytes
        from tx.engine.pool import ModelPool, default_budget_bytes
    except ImportError:
        sys.exit("error: tx.engine is not available (the JAX engine failed to import)")
    try:
        config = engine_config(args)
    except ValueError as err:  # a flag out of range: say which, no traceback
        sys.exit(f"error: {err}")

    def build(name: str, model_dir: Path) -> Any:
        return build_runner(dataclasses.replace(config, base_model=name), model_dir)

    budget = int(args.memory_budget_gb * 1e9) if args.memory_budget_gb else default_budget_bytes()
    no_loads = NO_LOADS if args.coordinator else ""
    return ModelPool(build, lambda model_dir: estimate_bytes(model_dir, args.dtype), budget, no_loads=no_loads)


def build_catalog(args: argparse.Namespace, pool: ModelPool | None, uploads: UploadStore | None = None) -> ModelCatalog:
    """The models clients may name; every `--base-model` is located, described and (given a `pool`) loaded
    now. Without a pool (`--role api`) nothing loads: each model is described from its `config.json`, and
    the catalog lists no on-demand models as loaded. `uploads`: where `upload:NAME` strings are found
    (`create_app` gives the catalog its default store otherwise)."""
    allow = tuple(args.allow_models) if args.allow_models else default_allow(args.host, args.base_model)
    rules = ModelRules(allow, args.max_seq_len, args.max_lora_rank, args.max_lora_adapters)
    hooks = (uploads.find_upload, uploads.list_uploads) if uploads is not None else (None, None)
    catalog = ModelCatalog(rules, pool.loaded if pool is not None else dict, *hooks)
    catalog.only_preloaded = NO_LOADS if args.coordinator else ""
    try:
        for name in args.base_model:
            model_dir = Path(catalog.preload(name).model_dir)
            if pool is not None:
                pool.preload(name, model_dir)
    except (FileNotFoundError, ValueError, MemoryError, RequestError) as err:  # bad model: say so, no traceback
        sys.exit(f"error: {err}")
    return catalog


def _announce_when_ready(server: uvicorn.Server, host: str, port: int, key_hint: str) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if not server.started:
        return
    shown = "localhost" if host in ("0.0.0.0", "127.0.0.1", "::") else host
    url = f"http://{shown}:{port}"
    print(f"\nPoint the tinker SDK at this server:\n  export TINKER_API_KEY={key_hint}\n  export TINKER_BASE_URL={url}")
    print(f"  (or ServiceClient(base_url={url!r}, api_key={key_hint!r}))")
    print(f"SmolGym ready on http://{host}:{port}", flush=True)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" is not news
    if level.upper() != "DEBUG":  # orbax narrates every checkpoint step through absl at INFO
        logging.getLogger("absl").setLevel(logging.WARNING)


def recover(db: Database, data_dir: Path) -> LostState:
    """Engine side only: settle the work a previous engine left (`SqlQueue.recover`: claimed work fails,
    pending work stays queued) and sweep half-written checkpoints; returns the state that died with it.
    Never run by an API server: another process's engine may be running that work right now."""
    found = db.queue.recover()
    if found.failed:
        log.warning("failed %d requests that were running when the previous engine stopped", found.failed)
    if found.pending:
        log.info("%d requests queued before the restart will run now", found.pending)
    if found.lost.runs:
        log.warning("%d training runs lost their in-memory state at the restart", len(found.lost.runs))
    from tx.engine.checkpoints import sweep_partial  # JAX loads with the engine, not with the CLI

    swept = sweep_partial(checkpoints_root(data_dir))
    if swept:
        log.warning("removed %d half-written checkpoint directories left by a previous run", len(swept))
    return found.lost


def engine_lease(db: Database, data_dir: Path) -> EngineLease:
    """This process's claim to be the one engine on its data directory and database (`tx.db.lease`), taken
    before `recover`: a second engine's recovery would fail the live one's running work. Refused, it exits."""
    try:
        return take_engine_lease(db.engine, data_dir)
    except EngineBusy as err:
        raise SystemExit(f"smolgym: {err}") from None


def start_engine(
    args: argparse.Namespace, db: Database, uploads: UploadStore, leader: Any = None
) -> tuple[Engine, ModelPool, ModelCatalog]:
    """`leader`: the plan channel to the follower processes (`tx.api.cluster.join`), or None on one."""
    from tx.engine.loop import Engine  # JAX loads with the engine, never in an API-only process
    from tx.engine.multihost import LeaderRunner
    from tx.engine.restart import RestartGate

    lost = recover(db, Path(args.data_dir))
    pool = build_pool(args)
    engines: list[Engine] = []  # filled below: a follower lost while the models load fails nothing
    if leader is not None:
        watch_followers(args, leader, db, lambda: engines[0].in_flight() if engines else [])
    catalog = build_catalog(args, pool, uploads)
    runner = LeaderRunner(pool, leader) if leader is not None else pool
    engine = Engine(db.queue, RestartGate(runner, lost))  # in front of every process: lost work runs nowhere
    engines.append(engine)
    engine.start()
    return engine, pool, catalog


def serve(
    args: argparse.Namespace, settings: Settings, db: Database, catalog: ModelCatalog, uploads: UploadStore
) -> None:
    app = create_app(settings, db, catalog, uploads)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    key_hint = sorted(settings.api_keys)[0] if settings.api_keys else "tml-local"
    threading.Thread(target=_announce_when_ready, args=(server, args.host, args.port, key_hint), daemon=True).start()
    server.run()


def wait_for_signal() -> None:
    """`--role engine`: block until SIGTERM or SIGINT (the engine thread does the work)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("SmolGym engine ready", flush=True)
    stop.wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _configure_logging(args.log_level)
    cluster = cluster_of(args)
    if cluster is not None and argv is None:
        pin_hash_seed()
    leads, channel = join(args, cluster) if cluster is not None else (True, None)
    if not leads:
        run_follower(args, channel)
        return
    api_keys = load_api_keys(args.api_key, args.api_keys_file)
    db = open_database(args.database_url, args.data_dir, session_timeout_s=args.session_timeout)
    settings = Settings(
        data_dir=Path(args.data_dir),
        api_keys=api_keys,
        max_upload_bytes=int(args.max_upload_gb * GB),
        max_runs=args.max_runs,
    )
    uploads = UploadStore(settings.data_dir / "uploads", settings.max_upload_bytes)
    engine = pool = lease = None
    try:
        if args.role == "api":
            serve(args, settings, db, build_catalog(args, None, uploads), uploads)
            return
        lease = engine_lease(db, settings.data_dir)
        engine, pool, catalog = start_engine(args, db, uploads, channel)
        if args.role == "engine":
            wait_for_signal()
        else:
            serve(args, settings, db, catalog, uploads)
    finally:
        if engine is not None and pool is not None:
            engine.stop()
            getattr(engine.runner, "close", lambda: None)()
            pool.close()
        if lease is not None:
            lease.release()
        db.close()


if __name__ == "__main__":
    main()
