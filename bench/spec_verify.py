"""What verifying proposed tokens costs: the step time of B decoding streams that each
verify k proposed tokens, against plain decode steps (k = 0), on one model.

    .venv/bin/python bench/spec_verify.py [--model PATH] [--dtype auto]
        [--batch-sizes 1,4,8,16,32] [--ks 0,1,2,4] [--context 256] [--steps 12]
        [--exactness N] [--json PATH]

In-process engine (TP 1), every step run on the engine's step thread (as
bench/profile_step.py does). For each batch size, B random prompts of `--context` tokens are
prefilled; then for each k, `--steps` steps run with a proposer that gives every request k
random tokens (the model rejects them: each step still gains one token per request, so
only the cost is measured; speculation's own batch back-off is bypassed) and the mean step
time is kept, with its ratio to k = 0 and the break-even acceptance: the share of proposals
that must be accepted for the step to pay for itself (a step of k proposals and acceptance a
yields 1 + (expected accepted tokens) tokens; at a per-token acceptance p, that is
1 + p + ... + p^k; break-even where that equals the cost ratio).

`--exactness N`: also N greedy requests of 32 tokens with the model as its own draft
(`--speculative-method draft`) and without speculation: how many outputs differ (the
random-weight shapes of bench/models.py: only this and the cost mean anything there).
Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

from common import print_table, random_prompts, write_json


def break_even(ratio: float, k: int) -> float | None:
    """The per-token acceptance p at which 1 + p + ... + p^k equals `ratio` (None: k = 0,
    or even p = 1 does not pay)."""
    if k == 0 or ratio > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        p = (low + high) / 2
        if sum(p**i for i in range(k + 1)) < ratio:
            low = p
        else:
            high = p
    return low


def step_costs(
    llm: Any, batch: int, ks: Sequence[int], context: int, steps: int
) -> dict[int, float]:
    """Mean seconds of a step of `batch` decoding streams (random prompts of `context`
    tokens) that each verify k random proposed tokens, for each k of `ks`, on `llm`'s
    in-process engine (its own step thread); its requests are gone afterwards."""
    from otel_engine import SamplingParams
    from otel_engine.config import SpeculativeConfig
    from otel_engine.sched.scheduler import ScheduledChunk
    from otel_engine.spec.speculator import Speculator

    class RandomProposals(Speculator):
        """k random tokens for every decoding request, every step."""

        def __init__(self, k: int, vocab: int) -> None:
            super().__init__(SpeculativeConfig(num_speculative_tokens=max(1, k)))
            self.k = k
            self.vocab = vocab
            self.rng = random.Random(0)

        def slots(self, request: Any, limit: int) -> int:
            return min(self.k, limit)

        def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
            for chunk in chunks:
                drafts = [
                    self.rng.randrange(self.vocab // 2, self.vocab)
                    for _ in range(chunk.num_spec_slots)
                ]
                chunk.draft_token_ids = drafts
                chunk.num_tokens += len(drafts)

        def observe(self, request: Any, proposed: int, accepted: int) -> None:
            pass

    frontend = llm._frontend
    client = frontend.client
    core = client.core
    vocab = core.arch.vocab_size
    prompts = random_prompts(batch, context, vocab, batch)
    total = 4 + (steps + 2) * len(ks)
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        frontend.add_request(f"v{batch}-{index}", prompt, params)

    def measure(k: int) -> float:
        core.speculator = core.scheduler.speculation = RandomProposals(k, vocab)
        for _ in range(2):
            core.step()
        started = time.perf_counter()
        for _ in range(steps):
            core.step()
        return (time.perf_counter() - started) / steps

    def run_all() -> dict[int, float]:
        while any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()
        ):
            core.step()
        return {k: measure(k) for k in ks}

    try:
        return dict(client._steps.call(run_all, 1200))
    finally:
        core.scheduler.abort(list(core.scheduler.requests))
        frontend.outputs.states.clear()
        core.speculator = core.scheduler.speculation = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--ks", default="0,1,2,4")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--exactness", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()

    from otel_engine import LLM, SamplingParams

    ks = [int(k) for k in args.ks.split(",")]
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    with LLM(model=args.model, dtype=args.dtype, kv_cache_memory_gib=2.0) as llm:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            times = step_costs(llm, batch, ks, args.context, args.steps)
            base = times[ks[0]]
            for k in ks:
                ratio = times[k] / base
                even = break_even(ratio, k)
                rows.append(
                    [
                        str(batch),
                        str(k),
                        f"{times[k] * 1e3:.1f}",
                        f"{ratio:.2f}",
                        "-" if even is None else f"{even:.2f}",
                    ]
                )
                results.append(
                    {
                        "batch": batch,
                        "k": k,
                        "step_s": times[k],
                        "ratio": ratio,
                        "break_even_acceptance": even,
                    }
                )
    print(
        f"model: {args.model or 'default (SmolLM2-135M-Instruct, Q4_1)'}, "
        f"dtype {args.dtype}, context {args.context}"
    )
    print_table(["streams", "k", "step ms", "vs k=0", "break-even acceptance"], rows)
    report: dict[str, Any] = {"cost": results}
    if args.exactness:
        report["exactness"] = exactness(args, llm_class=LLM, params_class=SamplingParams)
    write_json(args.json, report)


def exactness(args: argparse.Namespace, *, llm_class: Any, params_class: Any) -> dict[str, int]:
    """Greedy outputs with the model as its own draft against none: how many differ."""
    from otel_engine.model.loader import prepare_model_dir

    params = params_class(max_tokens=32, temperature=0.0, ignore_eos=True)
    with llm_class(model=args.model, dtype=args.dtype) as llm:
        vocab = llm._frontend.client.core.arch.vocab_size  # type: ignore[union-attr]
        prompts = random_prompts(args.exactness, 64, vocab, 77)
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    draft = args.model or prepare_model_dir(None)
    with llm_class(
        model=args.model, dtype=args.dtype, speculative_method="draft", speculative_model=draft
    ) as llm:
        outputs = llm.generate(prompts, params)
    differ = sum(
        list(o.outputs[0].token_ids) != want for o, want in zip(outputs, plain, strict=True)
    )
    accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in outputs)
    proposed = sum(o.metrics.get("num_draft_tokens", 0) for o in outputs)
    print(
        f"exactness: {differ} of {len(prompts)} greedy outputs differ; "
        f"{accepted}/{proposed} proposals accepted"
    )
    return {"requests": len(prompts), "differ": differ, "accepted": accepted, "proposed": proposed}


if __name__ == "__main__":
    main()
