"""The chaos ledger: clients of every kind while random faults fire, then every request
reconciled across the HTTP answer, its span, the metrics and its log line.

    .venv/bin/python bench/chaos.py [--duration 600] [--clients 16] [--tp 1]
        [--mode restart|shutdown|both] [--seed 0] [--model PATH|tiny] [--json out.json]

`restart`: one server with `--on-engine-failure restart`, a random injected fault in every
engine it starts (`OTEL_ENGINE_FAULT` as a list), a poison request every --poison-every
seconds, and SIGKILL/SIGSEGV to the engine core or a worker from outside. `shutdown`: server
lives, each ended by one random fault. The drill is tests/helpers/chaos.py; the
reconciliation tests/helpers/ledger.py (the CI test, tests/failures/test_ledger.py, runs the
same code). Prints the ledger; exits 1 on any mismatch, lost request, output that differs
from the fault-free run, failure the mode does not allow, or process left behind.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

from common import tiny_model, write_json

from otel_engine.config import EngineFailureMode
from tests.helpers.chaos import ChaosConfig, ChaosResult, run_chaos


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{key} {num}" for key, num in sorted(counter.items())) or "-"


def report(result: ChaosResult) -> dict[str, Any]:
    """Print the ledger of one run; return it as JSON-able figures."""
    config, ledger, comparison = result.config, result.ledger, result.comparison
    kinds = Counter(str(s.kind) for s in result.sent)
    first, last = result.resources[0], result.resources[-1]
    peak = {key: max(sample[key] for sample in result.resources) for key in first}
    figures = {
        "mode": str(config.mode),
        "tp": config.tensor_parallel_size,
        "duration_s": config.duration_s,
        "wall_s": result.wall_s,
        "server_lives": len(result.exit_codes),
        "exit_codes": dict(Counter(str(code) for code in result.exit_codes)),
        "requests_sent": len(result.sent),
        "requests_by_kind": dict(kinds),
        "not_sent_no_server_listening": result.num_not_sent,
        "faults_injected": sum(result.faults.values()),
        "faults_by_kind": dict(result.faults),
        "engine_restarts": result.num_restarts,
        "poison_verdicts": result.num_poison_verdicts,
        "outcomes": dict(ledger.outcomes),
        "lost": result.num_lost,
        "mismatches": {source: len(found) for source, found in ledger.mismatches.items()},
        "unexpected_failures": len(result.unexpected),
        "innocents_failed_as_poison": len(result.innocents),
        "compared_requests": comparison.num_requests,
        "compared_tokens": comparison.num_tokens,
        "outputs_different": comparison.num_different,
        "chars_duplicated": comparison.chars_duplicated,
        "chars_missing": comparison.chars_missing,
        "processes_left_behind": len(result.leftovers),
        "api_server_start": first,
        "api_server_end": last,
        "api_server_max": peak,
        "api_server_samples": result.resources,
    }
    print(
        f"== chaos: mode {config.mode}, TP {config.tensor_parallel_size}, "
        f"{config.duration_s:.0f} s ({result.wall_s:.0f} s wall), {config.num_clients} clients"
    )
    print(f"server lives: {figures['server_lives']}; exit codes: {figures['exit_codes']}")
    print(
        f"requests sent: {len(result.sent)} ({_counts(kinds)}); "
        f"not sent (no server listening): {result.num_not_sent}"
    )
    print(f"faults injected: {sum(result.faults.values())} ({_counts(result.faults)})")
    print(f"engine restarts: {result.num_restarts}; poison verdicts: {result.num_poison_verdicts}")
    print(f"outcomes: {_counts(ledger.outcomes)}")
    print(f"lost requests: {result.num_lost}; unexpected failures: {len(result.unexpected)}")
    print(
        f"non-poison requests failed as poison (in the batches of two failures of one type): "
        f"{len(result.innocents)}"
    )
    print("ledger mismatches: " + ", ".join(f"{k} {len(v)}" for k, v in ledger.mismatches.items()))
    print(
        f"compared with a fault-free run: {comparison.num_requests} requests, "
        f"{comparison.num_tokens} tokens; different: {comparison.num_different}; "
        f"chars duplicated {comparison.chars_duplicated}, missing {comparison.chars_missing}"
    )
    print(f"processes left behind: {len(result.leftovers)}")
    print(
        f"api_server fds/threads/RSS MiB: start {first['fds']}/{first['threads']}/"
        f"{first['rss_mib']}, end {last['fds']}/{last['threads']}/{last['rss_mib']}, "
        f"max {peak['fds']}/{peak['threads']}/{peak['rss_mib']}"
    )
    if config.mode == "restart":  # one api_server: its samples, every 30 s
        series = " ".join(f"{r['fds']}/{r['threads']}/{r['rss_mib']}" for r in result.resources)
        print(f"api_server fds/threads/RSS MiB every 30 s: {series}")
    for what in [
        *(m for found in ledger.mismatches.values() for m in found),
        *result.unexpected,
        *result.innocents,
        *comparison.examples,
        *result.leftovers,
    ][:20]:
        print(f"  ! {what}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds per mode")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1)
    parser.add_argument("--mode", choices=("restart", "shutdown", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--poison-every", type=float, default=30.0, help="seconds; 0: none")
    parser.add_argument(
        "--model", help="HF directory or .gguf, or `tiny` (default: the default model)"
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The tiny model's byte-level tokenizer makes the tools prompt ~500 tokens, the poison's
    # 1,600: a context of 2,048 holds both.
    model = tiny_model(context=2048) if args.model == "tiny" else args.model
    if model is None:
        from otel_engine.model.loader import default_model_path

        model = default_model_path()
    modes = ["restart", "shutdown"] if args.mode == "both" else [args.mode]
    print(f"cpus={os.cpu_count()}; load={os.getloadavg()[0]:.2f}; model={args.model or model}")
    results = []
    for mode in modes:
        config = ChaosConfig(
            model_dir=model,
            mode=EngineFailureMode(mode),
            duration_s=args.duration,
            num_clients=args.clients,
            tensor_parallel_size=args.tp,
            seed=args.seed,
            poison_every_s=args.poison_every,
        )
        result = run_chaos(config)
        results.append((report(result), result.is_clean))
        sys.stdout.flush()
    write_json(args.json, [figures for figures, _ in results])
    sys.exit(0 if all(clean for _, clean in results) else 1)


if __name__ == "__main__":
    main()
