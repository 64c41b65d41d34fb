"""`RayExecutor`: tensor-parallel ranks as actors of a running Ray cluster
(`--distributed-executor-backend ray`).

The engine core (where `serve` runs) joins the cluster as a driver, reserves one bundle per
rank in a placement group (`ray_cpus_per_rank` CPUs each, one GPU on CUDA; the strategy is
`--ray-placement-strategy`) and creates a `RayWorker` actor in each. From there the step path
is the local executor's: the same `ModelInput` to every rank over ZMQ (TCP, the core binding
on its node's address), rank 0's sampled tokens back, failure reports the same way, the
same probes for a hung rank. What differs is how a death is seen: each rank's pending `run`
call is its sentinel, and Ray fails it when the actor's process dies (killed, OOM, a native
fault) or its node goes; the error names the rank and its node.

Startup failures are one line within the ready timeout: no cluster to join, a placement group
the cluster cannot hold (checked against its resources first, then waited for), a rank that
fails to start on its node (a bad model path there). Shutdown kills every actor and removes
the placement group; the actors and the group belong to this driver, so Ray removes them too
if the engine core dies without a word.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

import msgspec

from otel_engine.config import Device, EngineConfig, RayPlacementStrategy
from otel_engine.errors import EngineStartupError, FailureCause
from otel_engine.executor.channel import StepChannel
from otel_engine.executor.hang import ask_ranks
from otel_engine.executor.rank_plans import collect
from otel_engine.executor.ray_worker import RayWorker, describe_node
from otel_engine.executor.responder import flight_recorder_env
from otel_engine.ipc.messages import (
    ErrorInfo,
    ModelInput,
    ModelOutput,
    RankReport,
    WorkerFailure,
)
from otel_engine.ipc.process import ENGINE_CORE, process_title
from otel_engine.ipc.roles import ProcessRole
from otel_engine.model.bandwidth import MemoryBandwidth
from otel_engine.model.limits import EngineLimits
from otel_engine.observability.faults import ENV_VAR as FAULT_ENV
from otel_engine.observability.setup import child_env
from otel_engine.timing import (
    GRACEFUL_WORKER_STOP_MAX_S,
    MONITOR_JOIN_S,
    RAY_PING_TIMEOUT_S,
    RAY_REACH_TIMEOUT_S,
)

logger = logging.getLogger(__name__)

# Passed to the actors as they are in the engine core, where set: the collectives' interface,
# Ray's own loopback switch, unbuffered output.
PASSED_VARIABLES = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "PYTHONUNBUFFERED",
    FAULT_ENV,
)
# Not passed: the engine core's own OTLP endpoint variables (child_env carries the engine's).
NOT_PASSED = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL")
RAY_ERROR_CHARS = 2000  # of Ray's own account of a death, in the worker.died log line


def import_ray() -> Any:
    """Ray, or a startup error that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise EngineStartupError(
            "--distributed-executor-backend ray needs Ray: pip install 'otel-engine[ray]'",
            failed_process=ENGINE_CORE,
        ) from error
    return ray


def actor_env(config: EngineConfig) -> dict[str, str]:
    """The environment of every rank's actor: the engine's observability settings (so its
    spans and logs go where the engine's go) and the variables it must share with the core."""
    env = child_env(config)
    for name, value in os.environ.items():
        if (name.startswith("OTEL_") and name not in NOT_PASSED) or name in PASSED_VARIABLES:
            env.setdefault(name, value)
    env.update(flight_recorder_env())
    return env


# Ray's exception types (`ray.exceptions`) that say on their own why a rank is gone.
DEATH_BY_TYPE = (
    ("ActorUnavailableError", "it is unreachable (its node is gone, or its process is)"),
    ("OutOfMemoryError", "Ray's memory monitor killed it (out of memory)"),
    ("NodeDiedError", "its node died"),
)


def death_reason(error: BaseException, exceptions: Any, node_alive: bool | None) -> str:
    """Why Ray says a rank's actor is gone, in a few words, from the type of its error
    (`exceptions`: `ray.exceptions`) and whether the rank's node is still alive (None: not
    known yet). Ray's own message, with ids and advice, goes to the `worker.died` line whole."""
    for name, reason in DEATH_BY_TYPE:
        if isinstance(error, getattr(exceptions, name)):
            return reason
    if isinstance(error, exceptions.RayActorError | exceptions.WorkerCrashedError):
        if getattr(error, "preempted", False):
            return "its node was preempted"
        return "its node died" if node_alive is False else "its process died"
    if isinstance(error, exceptions.RayTaskError):
        return f"it raised {type(error.cause).__name__}"
    return type(error).__name__


def unreachable(address: str) -> str:
    """Why nothing answers at a `host:port` cluster address ("" when something does, or
    when the address is not one: "auto", a `ray://` client address)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=RAY_REACH_TIMEOUT_S):
            return ""
    except OSError as error:
        return f"nothing answers there ({error.strerror or type(error).__name__})"


def same_cluster(address: str, joined: str) -> bool:
    """Whether `--ray-address` `address` is the cluster at GCS address `joined` (an address
    that is not `host:port`, such as "auto" or `ray://`, is taken to be)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return True
    joined_host, _, joined_port = joined.rpartition(":")
    try:
        same_host = socket.gethostbyname(host) == socket.gethostbyname(joined_host)
    except OSError:
        same_host = host == joined_host
    return same_host and port == joined_port


def bundles_held(per_node: list[dict[str, float]], bundle: dict[str, float], strategy: str) -> int:
    """How many of `bundle` the nodes' total resources hold under `strategy`: every node's
    share (PACK, SPREAD), at most one per node (STRICT_SPREAD), one node's (STRICT_PACK)."""
    shares = [int(min(res.get(k, 0.0) / v for k, v in bundle.items())) for res in per_node]
    if strategy == RayPlacementStrategy.STRICT_SPREAD:
        return sum(1 for share in shares if share >= 1)
    if strategy == RayPlacementStrategy.STRICT_PACK:
        return max(shares, default=0)
    return sum(shares)


class RayExecutor:
    """`tensor_parallel_size` ranks as Ray actors; rank 0 samples. The step path (`execute`,
    `check_health`, failure reports) is its `StepChannel`'s, over TCP; a rank's death is seen
    by its pending `run` call."""

    def __init__(self, config: EngineConfig, model_dir: str, limits: EngineLimits) -> None:
        ray = import_ray()
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self.fast_paths: dict[str, Any] | None = None
        self.memory_bandwidth: MemoryBandwidth | None = None
        self._ray = ray
        self._owns_session = False  # whether this executor's ray.init made the session
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._channel: StepChannel | None = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._nodes: list[dict[str, Any]] = []
        self._probes: list[str] = []
        self._group: Any = None
        deadline = time.monotonic() + config.timeouts.engine_ready_timeout
        try:
            self._join_cluster()
            host = str(ray.util.get_node_ip_address())
            address = f"tcp://{host}:*"
            channel = StepChannel(
                self.tp_size, address, [address] * self.tp_size, refine=self._refine
            )
            self._channel = channel
            self._group = self._place(deadline)
            self._actors = self._create_actors()
            store = self._get(
                self._actors[0].open_store.remote(self.tp_size, self._left(deadline)),
                deadline,
                rank=0,
            )
            starts = [
                actor.start.remote(
                    config.encode(),
                    model_dir,
                    limits.encode(),
                    *store,
                    channel.input_addresses[rank],
                    channel.results_address,
                )
                for rank, actor in enumerate(self._actors)
            ]
            ready = self._wait_started(starts, deadline)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._probes = [r["probe_address"] for r in ready]
        self._nodes = [{k: r[k] for k in ("node_id", "node_ip", "hostname", "pid")} for r in ready]
        self.fast_paths = collect([r["fast_paths"] for r in ready])
        self.memory_bandwidth = ready[0]["memory_bandwidth"]
        self._runs = [actor.run.remote() for actor in self._actors]
        logger.info(
            "ray.ranks_placed",
            extra={"ranks": [{"rank": r, **node} for r, node in enumerate(self._nodes)]},
        )
        self._monitor = threading.Thread(
            target=self._watch_workers, name="worker-monitor", daemon=True
        )
        self._monitor.start()

    @property
    def channel(self) -> StepChannel:
        assert self._channel is not None, "the step channel is bound before any rank starts"
        return self._channel

    # --- the step path -------------------------------------------------------------------

    def execute(self, step: ModelInput) -> ModelOutput:
        return self.channel.execute(step)

    def check_health(self, next_step: int | None = None) -> None:
        self.channel.check_health(next_step)

    def ask_ranks(self) -> list[RankReport | None]:
        """Every rank's answer to where it is (`hang.ask_ranks`), from any thread."""
        return ask_ranks(self.channel.context, self._probes)

    # --- startup -----------------------------------------------------------------------

    def _join_cluster(self) -> None:
        """Join the cluster as a driver; in a program that is one already (its own
        `ray.init`), use its session, which this executor will then never shut down."""
        address = self.config.parallel.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
        if self._ray.is_initialized():
            joined = self._ray.get_runtime_context().gcs_address
            if self.config.parallel.ray_address and not same_cluster(address, joined):
                raise EngineStartupError(
                    f"--ray-address {address!r} names another cluster than the one this "
                    f"process has joined ({joined!r}, by its own ray.init)",
                    failed_process=ENGINE_CORE,
                )
            return
        reach_error = unreachable(address)
        if reach_error:  # ray.init would retry for minutes
            raise EngineStartupError(
                f"cannot join the Ray cluster at {address!r}: {reach_error}",
                failed_process=ENGINE_CORE,
            )
        try:
            self._ray.init(
                address=address,
                namespace=f"otel-engine-{self.config.instance_id}",
                log_to_driver=False,  # the ranks log as configured (OTLP, their node's files)
                configure_logging=False,
                include_dashboard=False,
            )
        except Exception as error:
            raise EngineStartupError(
                f"cannot join the Ray cluster at {address!r}: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''} (start one with "
                "`ray start --head`, or pass --ray-address)",
                failed_process=ENGINE_CORE,
            ) from error
        self._owns_session = True

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.config.parallel.ray_cpus_per_rank)}
        if self.config.model.device == Device.CUDA:
            bundle["GPU"] = 1.0
        return bundle

    def _place(self, deadline: float) -> Any:
        """A placement group of one bundle per rank: refused at once if the cluster does not
        have the resources at all, else waited for until the ready timeout."""
        from ray.util.placement_group import placement_group

        bundle = self._bundle()
        strategy = self.config.parallel.ray_placement_strategy
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        fits = bundles_held([n.get("Resources", {}) for n in nodes], bundle, strategy)
        if fits < self.tp_size:
            raise EngineStartupError(
                f"the Ray cluster cannot place {self.tp_size} ranks of {bundle} each "
                f"({strategy}): its {len(nodes)} nodes hold {fits}",
                failed_process=ENGINE_CORE,
            )
        group = placement_group([dict(bundle) for _ in range(self.tp_size)], strategy=strategy)
        try:
            self._ray.get(group.ready(), timeout=self._left(deadline))
        except self._ray.exceptions.GetTimeoutError as error:
            self._ray.util.remove_placement_group(group)
            raise EngineStartupError(
                f"the Ray placement group of {self.tp_size} ranks of {bundle} each ({strategy}) "
                f"was not placed within --engine-ready-timeout "
                f"({self.config.timeouts.engine_ready_timeout:g} s): the cluster's free "
                "resources are taken",
                failed_process=ENGINE_CORE,
            ) from error
        return group

    def _create_actors(self) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self._ray.remote(RayWorker)
        bundle = self._bundle()
        env = actor_env(self.config)
        return [
            remote.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=2,  # `run` holds one thread; the other answers pings
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                ),
            ).remote(rank)
            for rank in range(self.tp_size)
        ]

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.1, deadline - time.monotonic())

    def _get(self, ref: Any, deadline: float, *, rank: int) -> Any:
        """One startup call's result; its failure as a one-line startup error naming the
        rank (and its node, once known)."""
        name = process_title(ProcessRole.WORKER, rank)
        try:
            return self._ray.get(ref, timeout=self._left(deadline))
        except self._ray.exceptions.GetTimeoutError as error:
            raise EngineStartupError(
                f"{name} did not start within --engine-ready-timeout "
                f"({self.config.timeouts.engine_ready_timeout:g} s)",
                failed_process=name,
            ) from error
        except self._ray.exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, BaseException) else error
            where = self._node_of(rank)
            raise EngineStartupError(
                f"{name}{where} failed to start: {type(cause).__name__}: "
                f"{str(cause).splitlines()[0] if str(cause) else ''}",
                failed_process=name,
                traceback=str(error),
            ) from error
        except self._ray.exceptions.RayActorError as error:
            raise EngineStartupError(
                f"{name}{self._node_of(rank)} died while starting: "
                f"{death_reason(error, self._ray.exceptions, None)}",
                failed_process=name,
            ) from error

    def _wait_started(self, starts: list[Any], deadline: float) -> list[Any]:
        """Every rank's `start` result, in rank order; the first that fails ends the wait
        (its peers would wait for it in the process group until the timeout)."""
        pending = {ref: rank for rank, ref in enumerate(starts)}
        results: dict[int, Any] = {}
        while pending:
            done, _ = self._ray.wait(list(pending), num_returns=1, timeout=self._left(deadline))
            if not done:
                names = ", ".join(
                    process_title(ProcessRole.WORKER, r) for r in sorted(pending.values())
                )
                raise EngineStartupError(
                    f"{names} did not start within --engine-ready-timeout "
                    f"({self.config.timeouts.engine_ready_timeout:g} s)",
                    failed_process=process_title(ProcessRole.WORKER, min(pending.values())),
                )
            for ref in done:
                rank = pending.pop(ref)
                results[rank] = self._get(ref, deadline, rank=rank)
        return [results[rank] for rank in range(len(starts))]

    def _node_of(self, rank: int) -> str:
        """` on <node>` for `rank`, asked of Ray while its actor still answers ("" if not)."""
        if rank < len(self._nodes):
            return f" on {describe_node(self._nodes[rank])}"
        with contextlib.suppress(Exception):
            node = self._ray.get(self._actors[rank].node.remote(), timeout=2)
            return f" on {describe_node(node)}"
        return ""

    # --- failures ------------------------------------------------------------------------

    def _watch_workers(self) -> None:
        """Wait for the first rank's `run` to end; an end while not stopping is a death."""
        ready, _ = self._ray.wait(self._runs, num_returns=1)
        if self._stopping:
            return
        rank = self._runs.index(ready[0])
        name = process_title(ProcessRole.WORKER, rank)
        said = ""
        try:
            self._ray.get(ready[0])
            how = "stopped serving"
        except Exception as error:  # what Ray says of the death
            how = death_reason(error, self._ray.exceptions, self._node_alive(rank))
            said = str(error)
        died = self._rank_died(rank, how)
        logger.error(
            "worker.died",
            extra={
                "worker": name,
                "node_ip": self._nodes[rank].get("node_ip"),
                "node_id": self._nodes[rank].get("node_id"),
                "how": how,
                "ray_error": said[:RAY_ERROR_CHARS],
            },
        )
        self.channel.rank_died(died)

    def _refine(self, root: ErrorInfo, failures: list[WorkerFailure]) -> ErrorInfo:
        """The channel's choice, checked against the ranks that said nothing: Ray sees a
        node go only after its health checks fail (seconds), while the peers' collectives
        break at once and they report that; a rank that neither reported nor answers a ping
        is the cause. The failed rank's node is named where its own report could not know
        it."""
        if root.type != FailureCause.WORKER_DIED:
            reporters = {f.rank for f in failures} | {root.rank}
            silent = self._silent_rank(reporters)
            if silent is not None:
                root = self._rank_died(*silent)
        if root.rank is not None and root.rank < len(self._nodes) and "node" not in root.location:
            node = describe_node(self._nodes[root.rank])
            where = f"rank {root.rank} on {node}"
            root = msgspec.structs.replace(
                root, location=f"{root.location} ({where})" if root.location else where
            )
        return root

    def _node_alive(self, rank: int) -> bool | None:
        """Whether the node `rank` ran on is alive, as the cluster says (None: unknown)."""
        if rank >= len(self._nodes):
            return None
        with contextlib.suppress(Exception):
            for node in self._ray.nodes():
                if node.get("NodeID") == self._nodes[rank].get("node_id"):
                    return bool(node.get("Alive"))
        return None

    def _rank_died(self, rank: int, how: str) -> ErrorInfo:
        """`WorkerDied` of `rank`, naming its node and `how` (also client-safe: `location`)."""
        name, node = process_title(ProcessRole.WORKER, rank), describe_node(self._nodes[rank])
        return ErrorInfo(
            type=FailureCause.WORKER_DIED,
            message=f"{name} on {node} died: {how}",
            process=name,
            rank=rank,
            location=f"rank {rank} on {node}: {how}",
        )

    def _silent_rank(self, reporters: set[int | None]) -> tuple[int, str] | None:
        """The first rank outside `reporters` that does not answer a ping (dead, or on a
        node that is gone), and how; None when each answers."""
        pings = {
            rank: actor.node.remote()
            for rank, actor in enumerate(self._actors)
            if rank not in reporters
        }
        for rank, ref in pings.items():
            try:
                self._ray.get(ref, timeout=RAY_PING_TIMEOUT_S)
            except self._ray.exceptions.GetTimeoutError:
                return (
                    rank,
                    f"it did not answer within {RAY_PING_TIMEOUT_S:g} s (its node is gone?)",
                )
            except Exception as error:
                return rank, death_reason(error, self._ray.exceptions, self._node_alive(rank))
        return None

    # --- what the core asks --------------------------------------------------------------

    def placement(self) -> list[dict[str, Any]]:
        """Where each rank runs (for the crash dump): rank, Ray node id, node address, host."""
        return [
            {"rank": rank, **{k: node[k] for k in ("node_id", "node_ip", "hostname")}}
            for rank, node in enumerate(self._nodes)
        ]

    def process_pids(self) -> dict[str, int | None]:
        return {ENGINE_CORE: os.getpid()}  # the ranks' processes are on their nodes

    def kill(self) -> None:
        """Kill every rank's actor now (fatal paths)."""
        self._stopping = True
        for actor in self._actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)

    def shutdown(self, *, graceful: bool = True) -> None:
        """Ask the ranks to stop (their `run` returns), then kill what is left, remove the
        placement group and leave the cluster if this executor joined it: nothing of this
        engine stays in it, and a session the program opened itself stays open."""
        self._stopping = True
        channel = self._channel
        is_running = channel is not None and not channel.failed and bool(self._runs)
        if graceful and is_running and channel is not None and channel.send_stop():
            timeout = min(self.config.timeouts.shutdown_timeout, GRACEFUL_WORKER_STOP_MAX_S)
            with contextlib.suppress(Exception):
                self._ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        self.kill()
        if self._group is not None:
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(self._group)
        if self._monitor is not None:
            self._monitor.join(timeout=MONITOR_JOIN_S)
        if channel is not None:
            channel.close()
        if self._owns_session:
            with contextlib.suppress(Exception):
                self._ray.shutdown()
