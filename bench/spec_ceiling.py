"""What prompt lookup could give at one stream on a prompt set, whatever the plan: the
model's greedy answers replayed through the lookup, verified the cheapest way there is.

    .venv/bin/python bench/spec_ceiling.py [--model PATH] [--dtype bfloat16]
        [--sets code_edit,quoting] [--max-tokens 128] [--num-speculative-tokens 8]
        [--ngram-min 2] [--ngram-max 4] [--steps 12] [--json PATH]

In-process engine, as `make run` serves the model (the default: SmolLM2-135M-Instruct, Q4_1):
1. each prompt of a set (bench/spec_prompts.py) is answered greedily without speculation,
   one at a time, as bench/speculative.py's server answers it: its prompt and answer token
   ids, and its time to the first token (the prefill);
2. the answer is replayed through the lookup (otel_engine/spec/ngram.py): at each decode
   position, the tokens the lookup proposes from the prompt and the answer before it (at
   most K), and how many of them the answer's next tokens match;
3. what a one-stream step that verifies k proposals costs, k = 0..K, is measured as
   bench/spec_verify.py measures it (at the set's median prompt-and-answer length);
4. each answer's decode is then costed three ways: plain (a step per token); `K`: every
   step verifies all the lookup proposes, up to K, as the engine would with a plan that
   always verifies; and `oracle`: at each position the k (0..K) that makes the whole answer
   cheapest, chosen knowing how many proposals the answer will match (a shortest path over
   the positions). No plan can beat the oracle with this lookup and these step costs, and a
   verification that cost nothing would give `free`.

Per set: tokens per verifying step at K, and each way's speed-up in decode time and in tok/s
(the prefill included, as bench/speculative.py's tok/s includes it). Prints numbers only;
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from common import print_table, write_json
from spec_prompts import PROMPT_SETS
from spec_verify import step_costs


def matched(proposals: Sequence[int], answer: Sequence[int], position: int) -> int:
    """How many of `proposals`, in order, equal the answer's tokens from `position` on."""
    count = 0
    for proposed, actual in zip(proposals, answer[position:], strict=False):
        if proposed != actual:
            break
        count += 1
    return count


def replay(
    prompt: Sequence[int], answer: Sequence[int], n_min: int, n_max: int, k: int
) -> list[tuple[int, int]]:
    """For each decode position of `answer` (1 on: position 0 comes from the prefill), the
    number of tokens the lookup proposes there and how many of them the answer matches."""
    import numpy as np

    from otel_engine.spec.ngram import lookup

    tokens = np.asarray([*prompt, *answer], dtype=np.int32)
    positions = []
    for position in range(1, len(answer)):
        proposals = lookup(tokens[: len(prompt) + position], n_min, n_max, k)
        positions.append((len(proposals), matched(proposals, answer, position)))
    return positions


def decode_seconds(positions: Sequence[tuple[int, int]], cost: Sequence[float]) -> dict[str, float]:
    """Seconds to decode an answer whose decode positions are `positions` ((proposed,
    matched) each) with steps costing `cost[k]` for k proposals: plain, always all the
    lookup proposes (`K`), the `oracle`'s cheapest k at each position, and `free` (every
    proposal verified at a plain step's cost)."""
    count = len(positions)
    plain = count * cost[0]
    always = free = 0.0
    position = 0
    while position < count:
        proposed, match = positions[position]
        always += cost[proposed]
        position += 1 + match
    position = 0
    while position < count:
        free += cost[0]
        position += 1 + positions[position][1]
    best = [0.0] * (count + 1)  # best[i]: the cheapest way from decode position i to the end
    for position in range(count - 1, -1, -1):
        proposed, match = positions[position]
        best[position] = min(
            cost[k] + best[min(count, position + 1 + min(k, match))] for k in range(proposed + 1)
        )
    return {"plain": plain, "K": always, "oracle": best[0], "free": free}


def tokens_per_step(positions: Sequence[tuple[int, int]]) -> float:
    """Tokens a step gives when every step verifies all the lookup proposes."""
    steps = position = 0
    while position < len(positions):
        steps += 1
        position += 1 + positions[position][1]
    return len(positions) / steps if steps else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sets", default="code_edit,quoting")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=8, metavar="K")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps timed per k")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in PROMPT_SETS]
    if unknown:
        parser.error(f"unknown sets: {', '.join(unknown)}")

    from otel_engine import LLM, SamplingParams

    k = args.num_speculative_tokens
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows: list[list[str]] = []
    report: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "k": k, "sets": {}}
    with LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False) as llm:
        for set_name in sets:
            answers = []
            for prompt in PROMPT_SETS[set_name]:
                (out,) = llm.chat([{"role": "user", "content": prompt}], params)
                metrics = out.metrics
                answers.append(
                    {
                        "prompt": list(out.prompt_token_ids),
                        "answer": list(out.outputs[0].token_ids),
                        "prefill_s": metrics["first_token_time"] - metrics["arrival_time"],
                    }
                )
            context = int(statistics.median(len(a["prompt"]) + len(a["answer"]) for a in answers))
            costs = step_costs(llm, 1, list(range(k + 1)), context, args.steps)
            cost = [costs[j] for j in range(k + 1)]
            totals = dict.fromkeys(("plain", "K", "oracle", "free"), 0.0)
            prefill = 0.0
            positions_all = []
            for answer in answers:
                positions = replay(
                    answer["prompt"], answer["answer"], args.ngram_min, args.ngram_max, k
                )
                positions_all += positions
                for way, seconds in decode_seconds(positions, cost).items():
                    totals[way] += seconds
                prefill += answer["prefill_s"]
            per_step = tokens_per_step(positions_all)
            entry = {
                "num_prompts": len(answers),
                "context": context,
                "step_s": cost,
                "tokens_per_step_at_k": per_step,
                "prefill_s": prefill,
                "decode_s": totals,
                "decode_speed_up": {w: totals["plain"] / totals[w] for w in totals},
                "tok_s_speed_up": {
                    w: (prefill + totals["plain"]) / (prefill + totals[w]) for w in totals
                },
            }
            report["sets"][set_name] = entry
            for way in ("K", "oracle", "free"):
                rows.append(
                    [
                        set_name,
                        way,
                        f"{per_step:.2f}",
                        f"{entry['decode_speed_up'][way]:.2f}x",
                        f"{entry['tok_s_speed_up'][way]:.2f}x",
                        f"{prefill / (prefill + totals['plain']):.0%}",
                    ]
                )
            ratios = ", ".join(f"{j}: {cost[j] / cost[0]:.2f}" for j in range(k + 1))
            print(f"{set_name}: step cost over plain by k ({cost[0] * 1e3:.1f} ms plain): {ratios}")
    print_table(
        ["set", "verify", "tokens/step at K", "decode speed-up", "tok/s speed-up", "prefill share"],
        rows,
    )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
