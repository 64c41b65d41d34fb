"""Where one engine step's time goes: torch.profiler over decode steps of the default model.

    .venv/bin/python bench/profile_step.py [--model PATH] [--dtype bfloat16]
        [--batch-sizes 1,32] [--context 256] [--steps 20] [--rows 25]

For each batch size: B random prompts of `--context` - 16 tokens are prefilled, then
`--steps` decode steps run under torch.profiler (in-process engine, TP=1). Prints the mean
wall time per step, the share spent inside torch ops, and the top ops by self CPU time.
Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

from common import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from otel_engine import LLM, SamplingParams

    with LLM(model=args.model, dtype=args.dtype) as llm:
        core = llm._frontend.client.core  # type: ignore[union-attr]
        vocab = core.arch.vocab_size
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = random_prompts(batch, args.context - 16, vocab, batch)
            total = 16 + args.steps + 8
            params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
            frontend = llm._frontend
            for index, prompt in enumerate(prompts):
                frontend.add_request(f"p{batch}-{index}", prompt, params)
            client = frontend.client
            for _ in range(16):  # prefill and a few decodes
                client.get_output()

            # The profiled steps run in the client's step thread, where every step runs (its
            # outputs are not read): run from this thread instead, a step's OpenMP regions get
            # a second team of threads while the first spins, and took 40-100% longer.
            # The profiler records the thread that starts it, so it starts there too.
            def profiled() -> tuple[profile, float]:
                started = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        core.step()
                return prof, (time.perf_counter() - started) / args.steps

            prof, wall = client._steps.call(profiled, 600)  # type: ignore[union-attr]
            while core.has_work:
                client.get_output()
            frontend.outputs.states.clear()
            events = prof.key_averages()
            op_time = sum(e.self_cpu_time_total for e in events) / 1e6 / args.steps
            print(
                f"\n== batch {batch}: {wall * 1e3:.1f} ms per decode step "
                f"({batch / wall:.0f} tok/s), torch ops {op_time * 1e3:.1f} ms of it, "
                f"{torch.get_num_threads()} threads"
            )
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
