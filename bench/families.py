"""Offline throughput of every model family on a tiny random checkpoint, and of the mixtures
of experts with the grouped expert path against a dense loop over all experts.

    .venv/bin/python bench/families.py [--batch 8] [--output-len 128] [--dtype bfloat16]

Each family's checkpoint is the test suite's tiny one (tests/helpers/tiny_model.py: 2-3
layers, hidden 64, 768 tokens), written to a temporary directory. After a warm-up call,
`LLM.generate` of `--batch` random 32-token prompts, greedy, `ignore_eos`; output tokens per
second of the faster of two calls. For Mixtral and Qwen3-MoE also with `moe_forward` swapped
for `moe_forward_dense` (every expert on every token). Tiny shapes measure per-step overhead,
not matmul speed: the point is that no family falls off a cliff. Prints numbers only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, random_prompts

from otel_engine import LLM, SamplingParams
from otel_engine.model import llama, moe

PROMPT_LEN = 32


def measure(model_dir: str, args: argparse.Namespace) -> float:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype=args.dtype) as engine:
        engine.generate(random_prompts(args.batch, PROMPT_LEN, 768, 1), params)  # warm-up
        best = 0.0
        for attempt in range(2):
            prompts = random_prompts(args.batch, PROMPT_LEN, 768, 10 + attempt)
            started = time.perf_counter()
            outputs = engine.generate(prompts, params)
            seconds = time.perf_counter() - started
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    return best


def moe_layer_times(dtype: torch.dtype) -> list[list[str]]:
    """One MoE layer at a Qwen3-MoE-like shape (hidden 1024, 32 experts of 512, top 4):
    milliseconds per call, grouped and dense, for a decode-sized and prefill-sized batch."""
    generator = torch.Generator().manual_seed(0)
    experts, hidden, inner = 32, 1024, 512
    weights = moe.MoeWeights(
        router=torch.randn(experts, hidden, generator=generator).to(dtype),
        gate_up=(torch.randn(experts, 2 * inner, hidden, generator=generator) * 0.02).to(dtype),
        down=(torch.randn(experts, hidden, inner, generator=generator) * 0.02).to(dtype),
        top_k=4,
        normalize=True,
    )

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    rows = []
    for tokens in (8, 64, 512):
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        cells = []
        for forward in (moe.moe_forward, moe.moe_forward_dense):
            forward(x, weights, silu_mul)
            started = time.perf_counter()
            for _ in range(5):
                forward(x, weights, silu_mul)
            cells.append(f"{(time.perf_counter() - started) / 5 * 1000:.2f}")
        rows.append([str(tokens), *cells])
    return rows


def write_checkpoints(root: str) -> dict[str, str]:
    """Every family's tiny checkpoint, written by a child process: torch work on this
    process's main thread would give it a second OpenMP pool, which the in-process engine's
    step thread then competes with (3-4x slower steps)."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[2]);"
        "from tests.helpers.tiny_model import FAMILY_CONFIGS, write_tiny_family, write_tiny_llama;"
        "root = sys.argv[1];"
        "dirs = {'llama': write_tiny_llama(root + '/llama')};"
        "dirs.update({f: write_tiny_family(root + '/' + f, f) for f in sorted(FAMILY_CONFIGS)});"
        "print(json.dumps(dirs))"
    )
    repo = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", script, root, repo], check=True, capture_output=True, text=True
    )
    dirs: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        dirs = write_checkpoints(root)
        for family, model_dir in dirs.items():
            rate = measure(model_dir, args)
            rows.append(
                [family, "grouped" if family in ("mixtral", "qwen3_moe") else "", f"{rate:.1f}"]
            )
            print(f"[{family}] {rate:.1f} tok/s", flush=True)
            if family in ("mixtral", "qwen3_moe"):
                grouped = llama.moe_forward
                llama.moe_forward = moe.moe_forward_dense  # type: ignore[assignment]
                try:
                    rate = measure(model_dir, args)
                finally:
                    llama.moe_forward = grouped  # type: ignore[assignment]
                rows.append([family, "dense loop", f"{rate:.1f}"])
                print(f"[{family}] dense loop {rate:.1f} tok/s", flush=True)
    print(f"\n== batch {args.batch}, {PROMPT_LEN} + {args.output_len} tokens, {args.dtype}")
    print_table(["family", "experts", "tok/s"], rows)
    print("\n== one MoE layer, hidden 1024, 32 experts of 512, top 4 (ms per call)")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    print_table(["tokens", "grouped", "dense loop"], moe_layer_times(dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
