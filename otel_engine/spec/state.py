"""What speculative decoding keeps per request: its counts, its measured acceptance, and
when it next proposes (spec/speculator.py decides how many)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from otel_engine.sampling_params import SamplingParams
from otel_engine.spec.ngram import TokenHistory

# Verifications in a row that accept nothing before a request stops proposing for a while:
# it then sits out 1, 2, 4 ... up to MAX_SKIP_STEPS steps between tries.
MISSES_BEFORE_SKIP = 2
MAX_SKIP_STEPS = 32
DECAY = 0.8  # of the past, each verification: the estimate follows the text as it changes
PRIOR_WEIGHT = 2.0  # verifications' worth of the method's acceptance a request starts from


@dataclass(slots=True, eq=False)
class SpecState:
    """One request's speculation: what its proposals achieved (`num_proposed`,
    `num_accepted`, and the recent `hits` and `fails` its acceptance estimate is made of:
    a verification that kept a proposals of k adds a hits, and one fail unless it kept all),
    and `skip` steps without proposals after `misses` verifications in a row kept none."""

    num_proposed: int = 0  # proposed tokens verified, over the request's life
    num_accepted: int = 0  # of them, accepted
    num_verify_steps: int = 0  # steps that verified at least one proposed token
    hits: float = 0.0
    fails: float = 0.0
    misses: int = 0
    skip: int = 0
    history: TokenHistory = field(default_factory=TokenHistory)  # prompt lookup's buffer
    candidates: list[int] = field(default_factory=list)  # prompt lookup's, this step
    num_draft_computed: int = 0  # tokens whose K/V the draft model holds (draft method)
    draft_params: SamplingParams | None = None  # how the draft model samples (spec/draft.py)

    __crash_dump__: ClassVar[dict[str, Any]] = {
        "num_proposed": "value",
        "num_accepted": "value",
        "num_verify_steps": "value",
        "hits": "value",
        "fails": "value",
        "misses": "value",
        "skip": "value",
        "history": "is_set",  # token ids: never the values
        "candidates": "count",
        "num_draft_computed": "value",
        "draft_params": "is_set",
    }

    def acceptance(self, prior: float) -> float:
        """The chance that its next proposal is accepted: its recent verifications, and
        `prior` (the method's, over all requests) for PRIOR_WEIGHT more."""
        return (self.hits + PRIOR_WEIGHT * prior) / (self.hits + self.fails + PRIOR_WEIGHT)

    def take_turn(self) -> bool:
        """Whether the request may propose this step (False while it sits steps out)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def observe(self, proposed: int, accepted: int) -> None:
        """Learn from one verification of `proposed` tokens, `accepted` of them kept."""
        if proposed <= 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verify_steps += 1
        self.hits = DECAY * self.hits + accepted
        self.fails = DECAY * self.fails + (accepted < proposed)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_SKIP:
            self.skip = min(MAX_SKIP_STEPS, 2 ** (self.misses - MISSES_BEFORE_SKIP))
