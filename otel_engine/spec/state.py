"""What speculative decoding keeps per request: its counts, and how many tokens it may
propose next (the adaptive part of spec/speculator.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from otel_engine.sampling_params import SamplingParams
from otel_engine.spec.ngram import TokenHistory

# Verifications in a row that accept nothing before a request stops proposing for a while:
# it then sits out 1, 2, 4 ... up to MAX_SKIP_STEPS steps between tries.
MISSES_BEFORE_SKIP = 2
MAX_SKIP_STEPS = 32


@dataclass(slots=True, eq=False)
class SpecState:
    """One request's speculation: `k` tokens proposed next (1..max_k), grown by one after a
    step that accepted them all, cut to one more than were accepted after one that did not;
    `skip` steps without proposals after `misses` verifications in a row accepted none."""

    k: int
    num_proposed: int = 0  # proposed tokens verified, over the request's life
    num_accepted: int = 0  # of them, accepted
    num_verify_steps: int = 0  # steps that verified at least one proposed token
    misses: int = 0
    skip: int = 0
    history: TokenHistory = field(default_factory=TokenHistory)  # prompt lookup's buffer
    num_draft_computed: int = 0  # tokens whose K/V the draft model holds (draft method)
    draft_params: SamplingParams | None = None  # how the draft model samples (spec/draft.py)

    __crash_dump__: ClassVar[dict[str, Any]] = {
        "k": "value",
        "num_proposed": "value",
        "num_accepted": "value",
        "num_verify_steps": "value",
        "misses": "value",
        "skip": "value",
        "history": "is_set",  # token ids: never the values
        "num_draft_computed": "value",
        "draft_params": "is_set",
    }

    def take_turn(self) -> bool:
        """Whether the request proposes this step (False while it sits steps out)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def observe(self, proposed: int, accepted: int, max_k: int) -> None:
        """Learn from one verification of `proposed` tokens, `accepted` of them kept."""
        if proposed <= 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verify_steps += 1
        self.k = min(max_k, self.k + 1) if accepted == proposed else max(1, accepted + 1)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_SKIP:
            self.skip = min(MAX_SKIP_STEPS, 2 ** (self.misses - MISSES_BEFORE_SKIP))
