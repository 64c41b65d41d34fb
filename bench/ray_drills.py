"""The Ray executor's fault drills, timed: TP=2 with one rank on each node of Ray's own
two-node test cluster on this machine (loopback only).

    .venv/bin/python bench/ray_drills.py [--model PATH] [--clients 8] [--json out.json]

Each drill starts `otel-engine serve --distributed-executor-backend ray`, sends `--clients`
requests (half streaming) and, once every stream has its first token, fails the remote rank:
it raises at step 30 (`OTEL_ENGINE_FAULT`), its actor's process is SIGKILLed, its node is
removed from the cluster, or it hangs at step 30 (`--step-timeout 3`). Reported, from the
fault (the kill, the removal, or the fault's step, read from the first client's stream):
the last client's error, the server's exit, and until nothing of the engine is left in the
cluster; and the error the clients got. The model defaults to the tiny test model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from common import fmt, print_table, tiny_model

from tests.failures.crowd import run_crowd
from tests.helpers.ray_cluster import (
    placed,
    remove_worker_node_of,
    restore_nodes,
    serve_on,
    start_cluster,
    wait_nothing_left,
)

DRILLS = ("raise", "sigkill", "node_removed", "hang")


def run_drill(cluster: Any, model: str, kind: str, clients: int, log_dir: Path) -> dict[str, Any]:
    args: tuple[str, ...] = ()
    env = {}
    if kind == "raise":
        env["OTEL_ENGINE_FAULT"] = "worker:raise:rank=1:step=30"
    if kind == "hang":
        env["OTEL_ENGINE_FAULT"] = "worker:hang:rank=1:step=30"
        args = ("--step-timeout", "3")
    server = serve_on(cluster, model, log_dir / f"{kind}.log", *args, env=env)
    fault_at: list[float] = []

    def on_flowing() -> None:
        if kind == "sigkill":
            fault_at.append(time.time())
            os.kill(placed(server)[1]["pid"], signal.SIGKILL)
        elif kind == "node_removed":
            fault_at.append(time.time())
            remove_worker_node_of(cluster, server)

    try:
        server.wait_healthy(180)
        flowing_at = time.time()
        results = asyncio.run(run_crowd(server.base_url, clients, on_flowing=on_flowing))
        code = server.wait(120)
        exited_at = time.time()
    finally:
        server.cleanup()
        restore_nodes(cluster)
    gone_s = wait_nothing_left(30)
    # the step faults fire on their own: from when the streams flowed (an upper bound)
    start = fault_at[0] if fault_at else flowing_at
    ends = [r.ended_at for r in results if r.ended_at is not None]
    errors = [r.error for r in results if r.error is not None]
    return {
        "drill": kind,
        "clients_failed": len(errors),
        "clients": len(results),
        "last_error_s": max(ends) - start if ends else None,
        "exit_s": exited_at - start,
        "exit_code": code,
        "nothing_left_s": exited_at - start + gone_s,
        "message": errors[0]["message"] if errors else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory (default: the tiny test model)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model or tiny_model()
    log_dir = Path(tempfile.mkdtemp(prefix="otel-bench-ray-"))
    cluster = start_cluster()
    try:
        results = [run_drill(cluster, model, kind, args.clients, log_dir) for kind in DRILLS]
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    print(f"TP=2 on 2 Ray nodes; cpus={os.cpu_count()}; logs in {log_dir}")
    headers = ["drill", "failed / clients", "last error s", "exit s", "exit", "nothing left s"]
    rows = [
        [
            r["drill"],
            f"{r['clients_failed']} / {r['clients']}",
            fmt(r["last_error_s"], 2),
            fmt(r["exit_s"], 2),
            str(r["exit_code"]),
            fmt(r["nothing_left_s"], 2),
        ]
        for r in results
    ]
    print_table(headers, rows)
    for r in results:
        print(f"{r['drill']}: {r['message']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
