"""Decode speed of each kernels build against torch ops, with torch limited to the same level.

    .venv/bin/python bench/kernel_isa.py [--model PATH] [--dtypes bfloat16,float32]
        [--batch-sizes 1,8] [--output-len 64] [--levels avx2,avx512,avx512bf16] [--repeat 2]

For each level L (at or below this CPU's) and dtype, two runs of offline `LLM.generate` on
the default model, one after the other, each in a fresh process with torch's own kernels
capped at L (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`: bench/isa_caps.py), so that the CPU
looks like one that has L and no more:
- torch: `--kernels torch`;
- kernels: the compiled kernels built for L (`OTEL_ENGINE_KERNEL_ISA=L`), used whatever the
  level and dtype (this script lifts the rule, `fast_paths.kernels_pay_off`, in its child).
Prints output tokens/s (greedy, `ignore_eos`, 16 prompt tokens; after a warm-up run of the
same shapes, the best of `--repeat` runs) and the ratio; the rule in
otel_engine/model/fast_paths.py (`kernels_pay_off`) rests on these numbers.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import fmt, print_table, random_prompts
from isa_caps import LEVELS


def child(args: argparse.Namespace) -> None:
    """One run in this process: print {batch: tokens/s} as JSON."""
    from otel_engine import LLM, SamplingParams
    from otel_engine.model import fast_paths

    fast_paths.kernels_pay_off = lambda isa, dtype: True
    with LLM(model=args.model, dtype=args.dtype, kernels=args.kernels) as llm:
        vocab = len(llm.tokenizer)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        results = {}
        warmup = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for batch in args.batch_sizes:
            prompts = random_prompts(batch, 16, vocab, 7)
            llm.generate(prompts, warmup)  # the same shapes once: oneDNN's primitives, caches
            best = 0.0
            for _ in range(args.repeat):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            results[batch] = best
    print("RESULT " + json.dumps(results))


def run(level: str, dtype: str, kernels: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, **LEVELS[level].env(), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, __file__, "--child", "--dtype", dtype, "--kernels", kernels]
    command += ["--batch-sizes", ",".join(map(str, args.batch_sizes))]
    command += ["--output-len", str(args.output_len), "--repeat", str(args.repeat)]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}
    raise RuntimeError(f"{level} {dtype} {kernels} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--levels", default="avx2,avx512,avx512bf16")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (best kept)")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.child:
        child(args)
        return
    from otel_engine.model.kernels import ISA_LEVELS, cpu_isa

    top = ISA_LEVELS.index(cpu_isa())
    rows = []
    for level in args.levels.split(","):
        if ISA_LEVELS.index(level) > top:
            print(f"skipping {level}: above this CPU ({cpu_isa()})")
            continue
        for dtype in args.dtypes.split(","):
            torch_ops = run(level, dtype, "torch", args)
            compiled = run(level, dtype, "auto", args)
            for batch in args.batch_sizes:
                ratio = compiled[batch] / torch_ops[batch]
                rows.append(
                    [level, dtype, str(batch), fmt(torch_ops[batch]), fmt(compiled[batch]),
                     f"{ratio:.2f}x"]
                )  # fmt: skip
                print("  ".join(rows[-1]), flush=True)
    print_table(["level", "dtype", "batch", "torch tok/s", "kernels tok/s", "kernels/torch"], rows)


if __name__ == "__main__":
    main()
