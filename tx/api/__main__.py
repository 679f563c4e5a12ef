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
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from tx.api.app import create_app
from tx.api.cli import load_api_keys, parse_args
from tx.api.cluster import (
    NO_LOADS,
    cluster_of,
    join,
    pin_hash_seed,
    run_follower,
    watch_followers,
)
from tx.api.context import Settings
from tx.api.models import ModelCatalog, ModelRules, default_allow
from tx.api.paths import checkpoints_root
from tx.db import Database, open_database
from tx.db.lease import EngineBusy, EngineLease, take_engine_lease
from tx.protocol import LostState, RequestError
from tx.upload_store import GB, UploadStore

if TYPE_CHECKING:
    from tx.engine.loop import Engine
    from tx.engine.pool import ModelPool

log = logging.getLogger("tx.api")


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
            max_rows=args.decode_rows,
            max_seq_len=args.max_seq_len,
            prompt_cache_bytes=args.prompt_cache_mb << 20,
            cache_limit_bytes=int(args.decode_cache_gb * 1e9) if args.decode_cache_gb else None,
        ),
    )


def build_pool(args: argparse.Namespace) -> ModelPool:
    """THE ENGINE FACTORY: the one place the server builds the JAX engine. Each model the pool loads is
    one `tx.engine.build_runner(config)` with the flags' `EngineConfig`."""
    try:
        from tx.engine import build_runner
        from tx.engine.build import estimate_bytes
        from tx.engine.pool import ModelPool, default_budget_bytes
        from tx.engine.run_memory import RunMemory
    except ImportError:
        sys.exit("error: tx.engine is not available (the JAX engine failed to import)")
    try:
        config = engine_config(args)
    except ValueError as err:  # a flag out of range: say which, no traceback
        sys.exit(f"error: {err}")

    run_memory = RunMemory(int(args.max_run_state_gb * 1e9) if args.max_run_state_gb else None)

    def build(name: str, model_dir: Path) -> Any:
        return build_runner(dataclasses.replace(config, base_model=name), model_dir, run_memory)

    budget = int(args.memory_budget_gb * 1e9) if args.memory_budget_gb else default_budget_bytes()
    no_loads = NO_LOADS if args.coordinator else ""

    def estimate(model_dir: Path) -> int:
        return estimate_bytes(model_dir, args.dtype, args.max_lora_adapters)

    return ModelPool(build, estimate, budget, no_loads=no_loads, memory=run_memory)


def build_catalog(args: argparse.Namespace, pool: ModelPool | None, uploads: UploadStore | None = None) -> ModelCatalog:
    """The models clients may name; every `--base-model` is located, described and (given a `pool`) loaded
    now. Without a pool (`--role api`) nothing loads: each model is described from its `config.json`, and
    the catalog lists no on-demand models as loaded. `uploads`: where `upload:NAME` strings are found
    (`create_app` gives the catalog its default store otherwise)."""
    allow = tuple(args.allow_models) if args.allow_models else default_allow(args.host, args.base_model)
    rules = ModelRules(allow, args.max_seq_len, args.max_lora_rank, args.max_lora_adapters, (args.data_dir,))
    hooks = (uploads.find_upload, uploads.list_uploads) if uploads is not None else (None, None)
    catalog = ModelCatalog(rules, pool.loaded if pool is not None else dict, *hooks)
    catalog.only_preloaded = NO_LOADS if args.coordinator else ""
    try:
        for name in args.base_model:
            model_dir = Path(catalog.preload(name, pool.fetch_within_budget if pool is not None else None).model_dir)
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
    from tx.engine.checkpoints import saved_by, sweep_partial  # JAX loads with the engine, not with the CLI

    settled = db.queue.settle_saved(saved_by)  # before `recover`, which would fail them
    if settled:
        log.info("%d saves whose files were in place when the previous engine stopped are done", settled)
    found = db.queue.recover()
    if found.failed:
        log.warning("failed %d requests that were running when the previous engine stopped", found.failed)
    if found.pending:
        log.info("%d requests queued before the restart will run now", found.pending)
    if found.lost.runs:
        log.warning("%d training runs lost their in-memory state at the restart", len(found.lost.runs))
    swept = sweep_partial(checkpoints_root(data_dir))
    if swept:
        log.warning("removed %d half-written checkpoint directories left by a previous run", len(swept))
    return found.lost


def database(args: argparse.Namespace) -> Database:
    """The database, or a one-line exit naming why it cannot be opened (a Postgres not up yet, a bad URL)."""
    from sqlalchemy.exc import ArgumentError, OperationalError

    try:
        return open_database(
            args.database_url,
            args.data_dir,
            session_timeout_s=args.session_timeout,
            open_session_timeout_s=args.open_session_timeout,
        )
    except OperationalError as err:
        reason = str(err.orig).strip().splitlines()[0] if err.orig else type(err).__name__
        raise SystemExit(f"smolgym: cannot open the database: {reason}") from None
    except (ArgumentError, ValueError) as err:  # its message may quote the URL, password and all
        raise SystemExit(f"smolgym: --database-url is not a database URL ({type(err).__name__})") from None


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


def check_port(host: str, port: int) -> None:
    """Exit now if the address is taken: found only by uvicorn, after the model had loaded (minutes for a
    large one), and its exit status was the one a lost follower's exit documents."""
    if port == 0 or not host:  # "" binds every interface, which getaddrinfo cannot name
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        sys.exit(f"error: cannot listen on {host}:{port} ({err.strerror or err}): another server on the port, "
                 "or a --host this machine does not have?")  # fmt: skip


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
    db = database(args)
    settings = Settings(
        data_dir=Path(args.data_dir),
        api_keys=api_keys,
        max_upload_bytes=int(args.max_upload_gb * GB),
        max_runs=args.max_runs,
        max_runs_per_key=args.max_runs_per_key,
    )
    uploads = UploadStore(settings.data_dir / "uploads", settings.max_upload_bytes)
    if args.role != "engine":
        check_port(args.host, args.port)
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
