"""Ray's multi-node test cluster on this machine for the Ray executor's tests and
`bench/ray_drills.py`: a head and `num_workers` worker nodes, one CPU each, all on the
loopback address, and `otel-engine serve` with its ranks on them.

Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when it is imported: `LOOPBACK_ENV` must be in
the environment before `import ray` (this module sets it) and is passed to every serve.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.helpers.procs import ServerProcess

# Ray's addresses on 127.0.0.1 (not the host's), gloo's pairs on the loopback interface.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
os.environ.update(LOOPBACK_ENV)


def start_cluster(num_workers: int = 1) -> Any:
    """A `ray.cluster_utils.Cluster` of a head and `num_workers` nodes, one CPU each, with
    this process connected to it as a driver."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    for _ in range(num_workers):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="otel-engine-tests", log_to_driver=False)
    return cluster


def serve_on(
    cluster: Any, model: str, log: Path, *args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """`otel-engine serve` at TP=2 (float32) with its ranks on `cluster`, started."""
    flags = ["--model", model, "--tensor-parallel-size", "2", "--dtype", "float32"]
    flags += ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
    flags += ["--engine-ready-timeout", "120", *args]
    return ServerProcess(flags, env={**LOOPBACK_ENV, **(env or {})}, log_path=log).start()


def placed(server: ServerProcess) -> list[dict[str, Any]]:
    """Where each rank runs, from the engine core's `ray.ranks_placed` log line."""
    (line,) = [r for r in server.json_lines() if r.get("event") == "ray.ranks_placed"]
    return list(line["ranks"])


def leftovers() -> tuple[dict[str, Any], dict[str, str]]:
    """(actors alive, placement groups not removed) in the cluster this process is in."""
    import ray

    alive = ray._private.state.actors(actor_state_name="ALIVE")
    groups = {k: v["state"] for k, v in ray.util.placement_group_table().items()}
    return alive, {k: state for k, state in groups.items() if state != "REMOVED"}


def wait_nothing_left(timeout: float = 15.0) -> float:
    """Seconds until no actor is alive and every placement group is removed (raises after
    `timeout`)."""
    started = time.monotonic()
    while True:
        alive, groups = leftovers()
        if not alive and not groups:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"left in the cluster: {alive}, {groups}")
        time.sleep(0.1)


def remove_worker_node_of(cluster: Any, server: ServerProcess) -> int:
    """Remove the worker node (not the head, which the driver needs) and return the rank that
    ran there."""
    head = cluster.head_node.node_id
    ((rank, node_id),) = [(r["rank"], r["node_id"]) for r in placed(server) if r["node_id"] != head]
    (node,) = [n for n in cluster.list_all_nodes() if n.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)
    return int(rank)


def restore_nodes(cluster: Any, num_nodes: int = 2) -> None:
    while len(cluster.list_all_nodes()) < num_nodes:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
