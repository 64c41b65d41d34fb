"""Native-fault drills, counted: does every client's error and the crash dump name the signal,
the kernel and the Python frame, run after run?

    .venv/bin/python bench/native_fault_drill.py [--runs 10] [--tp 1,2] [--json out.json]

Each run serves the model (default: the tiny test model) with one kernel fault from
`OTEL_ENGINE_FAULT` (the kernels library's `fault_drill` at step 200, in worker rank TP-1)
while four clients (two streaming) are in flight, as tests/failures/test_native_thread_fault.py
does once: SIGSEGV on an OpenMP worker thread, SIGSEGV on the calling thread, SIGFPE and
SIGBUS on an OpenMP worker thread. Per case and TP it prints the runs, the runs in which
every client's error named the signal, the kernel and the frame, the runs in which the dump
(the --crash-dump-dir file and the one `engine_crash_dump` line) did, and the exit codes
seen; then one client's error and the first mismatch of any run that missed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from common import print_table, tiny_model

from otel_engine.observability.faults import FaultKind
from tests.helpers.native_faults import Case, Outcome, run_case

KINDS = {
    "SIGSEGV worker thread": FaultKind.NATIVE_THREAD_SEGFAULT,
    "SIGSEGV main thread": FaultKind.KERNEL_SEGFAULT,
    "SIGFPE worker thread": FaultKind.NATIVE_THREAD_FPE,
    "SIGBUS worker thread": FaultKind.NATIVE_THREAD_BUS_ERROR,
}


def drill(label: str, case: Case, model: str, runs: int, log_dir: Path) -> dict[str, Any]:
    """`runs` runs of `case`: how many named everything, the exit codes, the misses."""
    clients_ok = dump_ok = 0
    codes: collections.Counter[str] = collections.Counter()
    misses: list[str] = []
    example = ""
    started = time.monotonic()
    for run in range(runs):
        work_dir = log_dir / f"{case.id}-{run}"
        work_dir.mkdir(parents=True)
        try:
            outcome: Outcome | None = run_case(case, model, work_dir)
        except AssertionError as error:  # the server did not come up
            outcome = None
            misses.append(f"run {run}: {str(error)[:300]}")
        if outcome is None:
            codes["no start"] += 1
            continue
        codes[str(outcome.exit_code)] += 1
        client_wrong, dump_wrong = outcome.client_mismatches(), outcome.dump_mismatches()
        clients_ok += not client_wrong
        dump_ok += not dump_wrong
        misses += [f"run {run}: {m}" for m in (client_wrong + dump_wrong)[:1]]
        errors = [r.error["message"] for r in outcome.results if r.error]
        example = example or (errors[0] if errors else "")
    return {
        "case": label,
        "tp": case.tp,
        "fault": case.spec,
        "runs": runs,
        "clients_named": clients_ok,
        "dump_named": dump_ok,
        "exit_codes": dict(codes),
        "seconds_per_run": (time.monotonic() - started) / max(1, runs),
        "example": example,
        "misses": misses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per case and TP")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    parser.add_argument("--cases", default=",".join(KINDS), help="which cases, comma-separated")
    parser.add_argument("--model", help="HF directory (default: the tiny test model)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model or tiny_model()
    log_dir = Path(tempfile.mkdtemp(prefix="otel-bench-native-fault-"))
    results = [
        drill(label, Case(KINDS[label], tp=int(tp)), model, args.runs, log_dir)
        for label in args.cases.split(",")
        for tp in args.tp.split(",")
    ]
    print(f"cpus={os.cpu_count()}; logs and dumps in {log_dir}")
    headers = ["case", "TP", "runs", "clients named it", "dump named it", "exit codes", "s/run"]
    rows = [
        [
            r["case"],
            str(r["tp"]),
            str(r["runs"]),
            str(r["clients_named"]),
            str(r["dump_named"]),
            " ".join(f"{code}x{count}" for code, count in sorted(r["exit_codes"].items())),
            f"{r['seconds_per_run']:.1f}",
        ]
        for r in results
    ]
    print_table(headers, rows)
    for r in results:
        print(f"{r['case']}, TP {r['tp']}: {r['example']}")
        for miss in r["misses"]:
            print(f"  miss: {miss}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
