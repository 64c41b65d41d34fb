"""Attention alone: the compiled kernels against torch's path, per head size.

    .venv/bin/python bench/attention.py [--head-dims 64,128] [--batches 1,16]
        [--context 512] [--prompt 1024] [--repeats 20]

Times one layer's attention (rotary, cache writes and attention) as the engine runs it, in
bfloat16 on the paged cache with blocks scattered at random:
  decode   B sequences of `--context` cached tokens, one new token each;
  prefill  one fresh prompt of `--prompt` tokens.
Shapes are those of real models: head size 64 as Llama-3.2-1B (32 query heads, 8 KV heads),
head size 128 as Qwen2.5-3B (16 / 2) and Llama-3.1-8B (32 / 8). `KernelOps` runs the compiled
kernel where the engine would (its fast-path choice for that head size), `TorchOps` is the
path without kernels. Prints milliseconds per call (median); nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the repo root on sys.path for tests.helpers)

from tests.helpers.paged import step_metadata

SHAPES = {  # head size: (query heads, KV heads) of the models named above
    64: [(9, 3), (32, 8)],
    128: [(16, 2), (32, 8)],
}
BLOCK_SIZE = 16


def _time(run: object, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        began = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompts", default="128,1024")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import dataclasses

    import torch

    from otel_engine.model import fast_paths
    from otel_engine.model.layer_ops import KernelOps, TorchOps, make_layer_ops
    from otel_engine.model.layers import RotaryEmbedding

    cpu = torch.device("cpu")
    dtype = torch.bfloat16
    print("| head size | heads / KV heads | step | kernels ms | torch ms | torch / kernels |")
    print("|---|---|---|---|---|---|")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for heads, kv_heads in SHAPES[head_dim]:
            shape = fast_paths.ModelShape(head_dim=head_dim, rotary_dim=head_dim, tp_size=1)
            plan = fast_paths.choose(
                kernels_flag="auto",
                int4_flag="auto",
                device=cpu,
                dtype=dtype,
                shape=shape,
                block_size=BLOCK_SIZE,
            )
            rotary = RotaryEmbedding(head_dim, 8192, 10000.0, None, dtype, cpu)
            kernel = make_layer_ops(
                plan,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rotary=rotary,
                dtype=dtype,
                device=cpu,
            )
            if not isinstance(kernel, KernelOps):
                raise SystemExit(f"no compiled kernels here: {plan.summary()}")
            # the same plan with prompts in torch's fused attention
            without = dataclasses.replace(plan, choices=dict(plan.choices))
            without.decide(fast_paths.Path.PREFILL_KERNEL, False, "measured against")
            sdpa = KernelOps(without, heads, kv_heads, head_dim, rotary, dtype)
            ops = {
                "kernel": kernel,
                "sdpa": sdpa,
                "torch": TorchOps(heads, kv_heads, head_dim, rotary, cpu),
            }
            steps = {
                f"decode x{b}, {args.context} cached": ([1] * b, [args.context] * b)
                for b in (int(b) for b in args.batches.split(","))
            }
            for prompt in (int(p) for p in args.prompts.split(",")):
                steps[f"prefill {prompt}"] = ([prompt], [prompt])
            for step, (query_lens, seq_lens) in steps.items():
                need = sum(-(-n // BLOCK_SIZE) for n in seq_lens)
                metadata = step_metadata(query_lens, seq_lens, BLOCK_SIZE, 2 * need, 0)
                shape = (kv_heads, 2 * need, BLOCK_SIZE, head_dim)
                k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
                qkv = torch.randn(sum(query_lens), (heads + 2 * kv_heads) * head_dim).to(dtype)
                ms = {}
                for name, op in ops.items():
                    if name == "sdpa" and step.startswith("decode"):
                        continue
                    meta = op.build_metadata(**metadata)  # type: ignore[arg-type]
                    ms[name] = _time(
                        lambda op=op, meta=meta, qkv=qkv, k=k_cache, v=v_cache: op.attend(
                            qkv.clone(), k, v, meta
                        ),
                        args.repeats,
                    )
                sdpa_ms = (
                    f" (torch's fused attention there: {ms['sdpa']:.3f})" if "sdpa" in ms else ""
                )
                print(
                    f"| {head_dim} | {heads} / {kv_heads} | {step} | {ms['kernel']:.3f}{sdpa_ms} | "
                    f"{ms['torch']:.3f} | {ms['torch'] / ms['kernel']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
