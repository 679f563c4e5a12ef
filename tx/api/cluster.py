"""`python -m tx.api` over several processes (hosts): the flags, their checks, and each process's start.

`--coordinator HOST:PORT --num-processes N --process-id I` (or `SMOLGYM_COORDINATOR`,
`SMOLGYM_NUM_PROCESSES`, `SMOLGYM_PROCESS_ID`; or `--coordinator auto`, where JAX reads all three from a
cluster launcher such as Slurm or Open MPI) joins JAX's distributed runtime (`tx.engine.multihost`).
Process 0 is today's server (`--role all` or `engine`: database, HTTP, the engine loop) whose runner is
a `LeaderRunner`; every other process is a follower (`run_follower`): no database, no HTTP, the same
pool over the same global mesh, making the leader's calls. Start-up, in every process: join, set up the
plan channel (process 0 listens on `--plan-port` and tells the others where through a JAX broadcast),
compare fingerprints (a difference refuses the start, named), then load the `--base-model`s. Models
never load on demand: the catalog serves the preloaded list only. When a follower dies or stops
answering for `--follower-timeout` seconds, the leader fails its in-flight requests naming the process
and exits with status 3; queued requests stay queued for the restarted engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tx.protocol import RequestError

if TYPE_CHECKING:
    from tx.db import Database
    from tx.engine.multihost import Cluster

log = logging.getLogger("tx.api")
LOST_EXIT = 3  # the leader's exit status when a follower is lost
NO_LOADS = "an engine over several processes serves only its --base-model list; on-demand loading is not supported"


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = p.add_argument_group("several processes (hosts), docs/deploy.md")
    g.add_argument("--coordinator", default=env("SMOLGYM_COORDINATOR"), metavar="HOST:PORT",
                   help="process 0's address for JAX's distributed runtime ($SMOLGYM_COORDINATOR); 'auto': detected "
                        "from the cluster launcher (Slurm, Open MPI)")  # fmt: skip
    g.add_argument("--num-processes", type=int, default=env("SMOLGYM_NUM_PROCESSES"),
                   help="engine processes in all ($SMOLGYM_NUM_PROCESSES)")  # fmt: skip
    g.add_argument("--process-id", type=int, default=env("SMOLGYM_PROCESS_ID"),
                   help="this process's rank, 0 = the one serving HTTP ($SMOLGYM_PROCESS_ID)")  # fmt: skip
    g.add_argument("--plan-port", type=int, default=int(env("SMOLGYM_PLAN_PORT", "0")),
                   help="TCP port process 0 sends each round's plan on ($SMOLGYM_PLAN_PORT; default: any free "
                        "port)")  # fmt: skip
    g.add_argument("--follower-timeout", type=float, default=float(env("SMOLGYM_FOLLOWER_TIMEOUT", "60")),
                   help="seconds without a follower's heartbeat before process 0 exits ($SMOLGYM_FOLLOWER_TIMEOUT; "
                        "default 60)")  # fmt: skip


def check_cluster_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.coordinator is None:
        if args.num_processes not in (None, 1) or args.process_id not in (None, 0):
            p.error("--num-processes and --process-id need --coordinator HOST:PORT (or --coordinator auto)")
        return
    if args.coordinator != "auto":
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--coordinator must be HOST:PORT or auto, got {args.coordinator!r}")
        if args.num_processes is None or args.process_id is None:
            p.error("--coordinator HOST:PORT needs --num-processes and --process-id")
    if args.num_processes is not None and args.num_processes < 1:
        p.error(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.process_id is not None and not 0 <= args.process_id < (args.num_processes or 1 << 30):
        p.error(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    if args.role == "api":
        p.error("--role api runs no engine: start it without --coordinator (only engine processes join)")
    if not args.base_model:
        p.error(f"several processes need --base-model ({NO_LOADS})")
    if args.follower_timeout <= 0:
        p.error(f"--follower-timeout must be > 0, got {args.follower_timeout}")


def cluster_of(args: argparse.Namespace) -> Cluster | None:
    from tx.engine.multihost import Cluster

    if args.coordinator is None:
        return None
    if args.coordinator == "auto":
        return Cluster(None, args.num_processes, args.process_id)
    return Cluster(args.coordinator, args.num_processes, args.process_id)


def pin_hash_seed() -> None:
    """Every process must hash strings alike (a set's order decides the order of some engine calls): rerun
    this process with PYTHONHASHSEED=0 when it is unset. The fingerprint compares the seeds."""
    if os.environ.get("PYTHONHASHSEED") is None:
        argv = [sys.executable, "-m", "tx.api", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, "PYTHONHASHSEED": "0"})


def join(args: argparse.Namespace, cluster: Cluster) -> tuple[bool, Any]:
    """Join the runtime, check the mesh spans every device, and connect the plan channel: (True, `Leader`)
    on process 0, (False, a started `Follower`) elsewhere. Exits naming the problem when a check fails."""
    import jax
    from jax.experimental import multihost_utils

    from tx.api.__main__ import engine_config
    from tx.engine import multihost
    from tx.engine.plan_channel import Follower, Leader

    multihost.initialize(cluster)
    mesh = args.fsdp_size * args.tensor_parallel_size * args.expert_parallel_size
    if mesh != jax.device_count():
        sys.exit(f"error: the mesh (--fsdp-size x --tensor-parallel-size x --expert-parallel-size = {mesh}) must "
                 f"cover the {jax.device_count()} devices of all {jax.process_count()} processes")  # fmt: skip
    own = multihost.fingerprint(engine_config(args), args.base_model, Path(args.data_dir))
    leader = Leader.listen(args.plan_port, jax.process_count() - 1) if jax.process_index() == 0 else None
    address = f"{_advertised_host(cluster)}:{leader.port}" if leader is not None else ""
    address = bytes(multihost_utils.broadcast_one_to_all(_padded(address))).rstrip(b"\0").decode()
    try:
        if leader is not None:
            leader.accept(own, timeout_s=120)
            return True, leader
        follower = Follower.connect(address, jax.process_index(), own, timeout_s=120)
    except (RuntimeError, OSError) as err:
        sys.exit(f"error: {err}")
    follower.start()
    return False, follower


def _padded(text: str) -> Any:
    import numpy as np

    return np.frombuffer(text.encode().ljust(256, b"\0"), np.uint8)


def _advertised_host(cluster: Cluster) -> str:
    """Where the followers reach process 0: the coordinator's host when given, else this host's name."""
    if cluster.coordinator:
        return cluster.coordinator.rpartition(":")[0]
    return socket.getfqdn()


def run_follower(args: argparse.Namespace, follower: Any) -> None:
    """A follower process: the pool with every --base-model loaded, then the leader's calls until it stops."""
    from tx.api.__main__ import build_catalog, build_pool
    from tx.engine.multihost import follow

    pool = build_pool(args)
    build_catalog(args, pool)
    follow(pool, follower)


def watch_followers(args: argparse.Namespace, leader: Any, db: Database, in_flight: Callable[[], list[str]]) -> None:
    """On a lost follower: fail the engine's in-flight requests with the reason, then exit (the processes
    cannot continue without it; the operator or the cluster restarts them all)."""

    def lost(reason: str) -> None:
        message = f"{reason}; the engine stops and must be restarted with all its processes"
        log.error("%s", message)
        try:
            db.queue.finish_many([(fid, RequestError(message, "server")) for fid in in_flight()])
        finally:
            print(f"error: {message}", file=sys.stderr, flush=True)
            os._exit(LOST_EXIT)

    leader.watch(args.follower_timeout, lost)
