"""A fleet: otel-engine replicas behind vLLM's router (`vllm-router`), all on 127.0.0.1.

    .venv/bin/python bench/fleet.py [--model PATH] [--replicas 3] [--streams 48] [--json out.json]

Two measurements, numbers only (tests/fleet holds the bounds):

1. Prefix-cache hit rate by routing policy: six agents, each with its own system prompt, six
   requests each in a shuffled order, sent one after another through a router with each
   policy in turn; the hit rate is read from the replicas' own counters
   (`otel_engine_prefix_cache_hits_total / _queries_total`), each policy with prompts no other
   policy sent.
2. A replica dies under load, once with the router's default health checks (every 60 s) and
   once with the ones docs/operations.md recommends (every 1 s, one failure takes a replica
   out): `--streams` streams through a `power_of_two` router, and once each has its first token
   the engine core of replica 0 is SIGKILLed. Reported: streams failed against the victim's
   own in-flight count just before the kill, kill to the last failed client, kill to the
   router marking it unhealthy and to the last request the router sent it, new requests
   (sent one after another from the kill on) that failed, the victim's exit code and time.

The model defaults to the tiny test model, written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from common import fmt, print_table, tiny_model

from tests.helpers.fleet import (
    ROUTER_HEALTH_ARGS,
    Fleet,
    replica_death_drill,
    routed_hit_rate,
    shared_prefix_chats,
)

POLICIES = ("round_robin", "power_of_two", "cache_aware")


def hit_rates(model: str, replicas: int) -> dict[str, float]:
    with Fleet(model, num_replicas=replicas) as fleet:
        name = fleet.model
        return {
            policy: routed_hit_rate(fleet, policy, shared_prefix_chats(name, seed=seed))
            for seed, policy in enumerate(POLICIES)
        }


def drill(model: str, replicas: int, streams: int, router_args: tuple[str, ...]) -> dict[str, Any]:
    with Fleet(model, num_replicas=replicas, router_args=router_args) as fleet:
        result = replica_death_drill(fleet, num_streams=streams)
    exited = result.victim_exited_at
    return {
        "in_flight_on_victim": result.in_flight_on_victim,
        "failed": len(result.failed),
        "completed": len(result.completed),
        "clean_errors": sum(
            1 for r in result.failed if r.error and r.error.get("code") == "engine_dead"
        ),
        "last_failure_s": result.last_failure_s,
        "unhealthy_after_s": result.unhealthy_after_s,
        "last_routed_to_victim_s": result.last_routed_to_victim_s,
        "new_requests": len(result.probes),
        "new_requests_failed": sum(1 for p in result.probes if not p.ok),
        "exit_code": result.exit_code,
        "exit_s": None if exited is None else exited - result.killed_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf (default: the tiny test model)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model or tiny_model()
    print(f"replicas={args.replicas}; cpus={os.cpu_count()}; load={os.getloadavg()[0]:.2f}")

    rates = hit_rates(model, args.replicas)
    print("\nprefix-cache hit rate (36 chats, 6 system prompts, shuffled)")
    print_table(["policy", "hit rate"], [[p, fmt(r, 3)] for p, r in rates.items()])

    drills = {
        "router defaults (60 s checks)": drill(model, args.replicas, args.streams, ()),
        "1 s checks, 1 failure": drill(model, args.replicas, args.streams, ROUTER_HEALTH_ARGS),
    }
    print(f"\nreplica 0's engine core SIGKILLed under {args.streams} streams (power_of_two)")
    headers = ["router health checks", "failed / in flight", "engine_dead", "last failure s"]
    headers += ["unhealthy s", "last routed s", "new failed / sent", "exit", "exit s"]
    rows = [
        [
            name,
            f"{d['failed']} / {d['in_flight_on_victim']}",
            str(d["clean_errors"]),
            fmt(d["last_failure_s"], 2),
            fmt(d["unhealthy_after_s"], 2),
            fmt(d["last_routed_to_victim_s"], 2),
            f"{d['new_requests_failed']} / {d['new_requests']}",
            str(d["exit_code"]),
            fmt(d["exit_s"], 2),
        ]
        for name, d in drills.items()
    ]
    print_table(headers, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"hit_rates": rates, "drills": drills}, indent=2))


if __name__ == "__main__":
    main()
