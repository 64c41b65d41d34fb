"""The summary bench/models.py prints of its report: the level both engines ran at, one table
row per shape, format, engine and stream count (tok/s, TTFT, TPOT, decode bandwidth against the
peak, peak RSS, the CPU cores used and taken by others: a number measured while other processes
took more than `CONTENDED_CORES` is starred), and the prompt-processing table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import fmt
from decode_reads import counting_note, gbps, pct, peak_text

CONTENDED_CORES = 0.25  # CPU cores taken by other processes beyond which a number is suspect


def caps_text(report: dict[str, Any]) -> str:
    """The caps otel-engine ran under, as `NAME=value` words."""
    return " ".join(f"{k}={v}" for k, v in report["otel_engine"]["caps"].items()) or "none"


def _ran_as(run: dict[str, Any], report: dict[str, Any]) -> str:
    """The table's short form of how an engine ran: otel-engine's dtype and kernels build,
    llama.cpp's build."""
    if run["engine"] == "llama.cpp":
        return Path(report["llama_cpp"]["build_dir"]).name
    selected = run.get("selected") or {}
    return f"{selected.get('dtype', '?')}, kernels {selected.get('kernel_isa') or 'off'}"


def _cores(cores: dict[str, float]) -> str:
    """CPU cores the server and client used / other processes took."""
    return f"{cores['server'] + cores['client']:.2f} / {cores['other']:.2f}"


def _flag(cores: dict[str, float] | None) -> str:
    return "*" if cores and cores.get("other", 0.0) > CONTENDED_CORES else ""


def print_markdown(headers: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n== level {report['isa']} (this CPU: {report['cpu_isa']}); otel-engine caps: "
        f"{caps_text(report)}; "
        f"llama.cpp {Path(report['llama_cpp']['build_dir']).name} reports: "
        f"{' '.join(report['llama_cpp']['features'])}"
    )
    print(
        f"== {report['cpu_count']} CPUs, prompt {report['prompt_tokens']} + output "
        f"{report['max_tokens']} tokens (greedy, ignore_eos), prefill {report['prefill_tokens']} "
        f"tokens at batch 1, KV {report['context_per_stream']} tokens per stream; CPU busy "
        f"before start {report['cpu_busy_before_pct']:.0f}%"
    )
    print(f"== {peak_text(report.get('peak_read_bandwidth'))}\n")
    headers = [
        "shape", "format", "GiB", "engine", "ran as", "start s", "streams", "tok/s", "TTFT p50 ms",
        "TTFT p90 ms", "TPOT p50 ms", "decode GB/s", "of peak", "peak RSS core MB",
        "peak RSS tree MB", "cores / other",
    ]  # fmt: skip
    rows, prefill_rows = [], []
    for run in report["runs"]:
        common = [run["shape"], run["format"], fmt(run["file_gib"], 2), run["engine"]]
        if "error" in run and not run["levels"]:
            rows.append([*common, "-", "-", "-", f"failed: {run['error'][:80]}", *["-"] * 8])
        for level in run["levels"]:
            rows.append(
                [
                    *common,
                    _ran_as(run, report),
                    fmt(run.get("startup_s")),
                    str(level["concurrency"]),
                    fmt(level["tok_s"]) + _flag(level["cpu_cores"]),
                    fmt(level["ttft_median_ms"], 0),
                    fmt(level["ttft_p90_ms"], 0),
                    fmt(level["tpot_median_ms"]),
                    gbps(level.get("decode_bytes_per_second")),
                    pct(level.get("decode_of_peak")),
                    fmt(level["peak_rss_core_mb"], 0),
                    fmt(level["peak_rss_tree_mb"], 0),
                    _cores(level["cpu_cores"]),
                ]
            )
        if prefill := run.get("prefill"):
            prefill_rows.append(
                [
                    *common,
                    fmt(prefill["ttft_median_ms"], 0),
                    fmt(prefill["prefill_tok_s"]) + _flag(prefill["cpu_cores"]),
                    _cores(prefill["cpu_cores"]),
                ]
            )
    print_markdown(headers, rows)
    if prefill_rows:
        print(f"\nPrompt processing, {report['prefill_tokens']} tokens at batch 1:\n")
        print_markdown(
            ["shape", "format", "GiB", "engine", "TTFT ms", "prefill tok/s", "cores / other"],
            prefill_rows,
        )
    flagged = any("*" in cell for row in rows + prefill_rows for cell in row)
    if flagged:
        print(f"\n* other processes took more than {CONTENDED_CORES} CPU cores: too low, rerun.")
    print("\n" + counting_note(report.get("mean_decode_context")))
    print(
        "\nRSS: the sum of each process's peak; llama-server's includes the pages of the "
        "mmapped model file that it touched."
    )
