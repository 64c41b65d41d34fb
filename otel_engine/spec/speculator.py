"""How many tokens each decoding request proposes in a step, and where they come from.

The scheduler asks `slots` for each decoding request it schedules (the KV slots it then
allocates for that many more positions); the engine core calls `propose` on the step's
batch before it runs, which fills each chunk's `draft_token_ids` (at most its slots, maybe
none) and lengthens the chunk by them; after the step, `observe` learns from how many were
accepted (spec/verify.py). A request proposes fewer tokens while its proposals fail
(spec/state.py), and the step as a whole backs off as the batch grows: one decode step
reads every weight once whatever its batch, so extra positions cost little while the
batch is small, but at many streams the step's arithmetic, not its reads, is the limit,
and verifying proposals there costs as much as it saves.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_engine.config import SpeculativeConfig, SpeculativeMethod
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk
from otel_engine.spec.ngram import lookup
from otel_engine.spec.state import SpecState

# Decode positions (sequences plus their proposed tokens) a step may verify in all before
# speculation backs off: each of n decoding requests may propose up to (this - n) / n
# tokens, so none at this many streams. See docs/speculative.md for how it was measured.
STEP_VERIFY_POSITIONS = 32


class Speculator:
    """The adaptive part common to every method; `propose` is the method's."""

    method: SpeculativeMethod

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.step_cap = 0  # the current step's per-request cap (`start_step`)

    def start_step(self, num_running: int) -> None:
        """The scheduler begins a step with `num_running` running requests."""
        n = max(1, num_running)
        self.step_cap = max(0, (STEP_VERIFY_POSITIONS - n) // n)

    def slots(self, request: Request, limit: int) -> int:
        """How many proposed tokens `request`, decoding, may verify this step: its adaptive
        k within the step's cap and `limit` (what its budget, context and max_tokens
        leave)."""
        if limit <= 0 or self.step_cap <= 0:
            return 0
        state = request.spec
        if state is None:
            state = request.spec = SpecState(k=self.max_k)
        if not state.take_turn():
            return 0
        return min(state.k, self.step_cap, limit)

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        """Fill the chunks' `draft_token_ids` (at most `num_spec_slots` each) and lengthen
        them by as many, for the engine's step `step_id`."""
        raise NotImplementedError

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        if request.spec is not None:
            request.spec.observe(proposed, accepted, self.max_k)


class NgramSpeculator(Speculator):
    """Prompt lookup (spec/ngram.py): no second model, nothing to compute but a search."""

    method = SpeculativeMethod.NGRAM

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        config = self.config
        for chunk in chunks:
            if not chunk.num_spec_slots:
                continue
            state = chunk.request.spec
            assert state is not None
            tokens = state.history.sync(chunk.request)
            drafts = lookup(tokens, config.ngram_min, config.ngram_max, chunk.num_spec_slots)
            chunk.draft_token_ids = drafts
            chunk.num_tokens += len(drafts)


def make_speculator(config: SpeculativeConfig) -> Speculator | None:
    """The configured method's speculator (None: speculation is off). The draft model's is
    built by the engine core, which owns the model (spec/draft.py)."""
    if config.speculative_method == SpeculativeMethod.NGRAM:
        return NgramSpeculator(config)
    return None
