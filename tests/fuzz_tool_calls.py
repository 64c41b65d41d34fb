"""The tool-call parser's fuzz at full size: seeded model answers in every tool format
(tests/helpers/model_text.py), each streamed in random pieces and parsed whole. Prints, per
format, the cases, those whose whole answer has a call, those where it has an invalid one,
and those that break the property (a streamed call that does not parse, or a stream that
differs from the whole answer); exits 0 only when none does. The test suite runs a short
hypothesis version (tests/entrypoints/test_tool_parsers.py).

    .venv/bin/python -m tests.fuzz_tool_calls [--cases 20000] [--seed N] [--show 3]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter

from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.entrypoints.tools.format import TOOL_FORMATS
from otel_engine.entrypoints.tools.parser import ToolCallParser
from tests.helpers.model_text import TOOLS, answer, pieces, problems

CASES = 20_000  # docs/tools.md states it


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=CASES)
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--show", type=int, default=3, help="failing answers to print")
    args = parser.parse_args()
    formats = list(ToolFormatName)
    cases, with_calls, with_invalid = Counter[str](), Counter[str](), Counter[str]()
    failed = Counter[str]()
    kinds = Counter[str]()
    shown = 0
    for number in range(args.cases):
        rng = random.Random(args.seed * 1_000_003 + number)
        case = answer(rng, formats[number % len(formats)])
        stream = pieces(rng, case.text)
        found = problems(case, stream, json_answer=(number // len(formats)) % 2 == 1)
        cases[case.format] += 1
        whole = ToolCallParser(TOOL_FORMATS[case.format](), TOOLS).parse(case.text)
        with_calls[case.format] += bool(whole.calls)
        with_invalid[case.format] += bool(whole.num_invalid)
        if found:
            failed[case.format] += 1
            kinds.update(found)
            if shown < args.show:
                shown += 1
                print(f"case {number} ({case.format}, {case.reason}): {found}\n  {case.text!r}")
    print(f"{'format':<12} {'cases':>6} {'a call':>7} {'invalid':>8} {'failed':>7}")
    for format in [*formats, "all"]:
        row = [
            sum(counter.values()) if format == "all" else counter[format]
            for counter in (cases, with_calls, with_invalid, failed)
        ]
        print(f"{format:<12} {row[0]:>6} {row[1]:>7} {row[2]:>8} {row[3]:>7}")
    for kind, count in kinds.most_common():
        print(f"  {count:>6}  {kind}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
