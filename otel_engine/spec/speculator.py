"""How many tokens each decoding request proposes in a step, and where they come from.

At the start of a step the scheduler hands `start_step` its running requests; for the
decoding ones the speculator plans how many proposals each verifies (spec/cost.py: from
each request's measured acceptance, and what a step of that many sequences is measured to
cost), and the scheduler asks `slots` for each as it schedules it (the KV slots it then
allocates). The engine core calls `propose` on the step's batch before it runs, which
fills each chunk's `draft_token_ids` (at most its slots) and lengthens the chunk by them;
after the step, `observe` learns how many were accepted (spec/verify.py) and
`observe_step` what the step cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_engine.config import SpeculativeConfig, SpeculativeMethod
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk
from otel_engine.spec.cost import MIN_IMPROVEMENT, Plan, StepCost, plan
from otel_engine.spec.ngram import lookup
from otel_engine.spec.state import DECAY, SpecState

# A request's acceptance before its own proposals were verified: the method's recent one,
# but never below this. A request must try to learn: if text where proposals fail (free
# chat) set every new request's prior, a request that quotes its prompt would never
# propose, and so never show that its proposals are good. A try costs one verification;
# proposals that then fail are cut (spec/state.py).
PRIOR_ACCEPTANCE = 0.5
# A plan that expects less than this gain over no proposals rests on what a step of the
# batch's size costs without them, which the steps that verify never measure: where that was
# last measured more than EXPLORE_STEPS steps ago, or never past its first run (one slow
# first 16-sequence step, 26.9 ms where 15 took 23.3, had a 16-stream batch propose on
# every step), a step runs without proposals and measures it again. A plan that expects
# more (one stream, text it quotes) gains whatever that cost is off by, and never stops.
EXPLORE_BELOW_GAIN = 1.25
EXPLORE_STEPS = 32
# What verifying steps delivered against what their plans expected (tokens per second over
# a plain step's), by batch size, a moving average with this weight a step. A plan is
# trusted as far as its size's plans delivered: at 16 streams plans expecting 5-50% more
# delivered 0.89-1.26x, the acceptance of a request's next proposals and the cost of a
# larger step both being estimates. Where a size's plans under-deliver it stops proposing,
# but lets one verifying step through every EXPLORE_STEPS steps to learn again.
DELIVERED_WEIGHT = 0.1
# A draft model's prefill for a request (its prompt, or the tokens it gained while it
# proposed nothing) pays only over the later steps that propose for it, and is charged to a
# step as that step's share of them. A plan that expects less than this gain is marginal,
# and the later steps of its batch mostly propose nothing (a plan under-delivers, its size
# stops, a step measures the plain cost): at 16 streams on free chat, a marginal plan
# prefilled 16 prompts in one step (550 ms, 6.5 plain steps) and the requests then proposed
# a few times each; the level ran at 0.85-0.92x. So once the method has verified proposals
# (its acceptance is known, not the prior), a plan that expects less than this, times what
# its batch size's plans delivered (the draft's prefills counted), starts no request's
# draft: the requests whose draft would prefill are planned without proposals. (Those
# started go on.)
DRAFT_START_GAIN = EXPLORE_BELOW_GAIN
# A step's cost is kept by its number of sequences, but its attention grows with their
# contexts: the default model's plain 16-sequence step in float32 took 84 ms over code
# edits (about 11,000 context tokens) and 67 ms over free chat (about 1,600), and plans
# resting on the first had verifying look 1.3-1.5x better than a plain step where it was at
# most 1.1x. Where a batch size's plain step was measured over contexts this many times
# more (or fewer) tokens than the batch's now, and either holds at least CONTEXT_TOKENS, the
# next step runs without proposals and its time replaces what was measured (and starts no
# draft before that).
CONTEXT_MOVED = 2.0
CONTEXT_TOKENS = 4096


class Speculator:
    """The planning common to every method; `propose` (and `candidates`) is the method's."""

    method: SpeculativeMethod

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.step_cost = StepCost()  # the target's decode-only steps
        self.draft_cost: StepCost | None = None  # a draft model's forwards (draft.py)
        self.hits = self.fails = 0.0  # every request's recent verifications, decayed
        self.planned: dict[int, int] = {}  # id(request) -> proposals, this step
        self.num_plans = 0  # steps planned
        self.measured_at: dict[int, int] = {}  # sequences -> the last plan its step measured
        self.delivered: dict[int, float] = {}  # batch size -> delivered / expected gain
        self.verified_at: dict[int, int] = {}  # batch size -> the last plan that verified
        # (batch size, its verifying step's sequences, expected gain) of this step's plan
        self.step_plan: tuple[int, int, float] | None = None
        self.step_accepted = 0  # proposed tokens the step kept
        self.step_draft_seconds = 0.0  # a draft model's forwards this step
        self.plain_context: dict[int, int] = {}  # batch size -> context tokens, last measured
        self.step_size = self.step_context = 0  # this step's decoding requests, their tokens
        self.step_context_moved = False  # `_context_moved` for this step, decided once

    @property
    def acceptance(self) -> float:
        """A request's prior: the method's recent acceptance, at least PRIOR_ACCEPTANCE."""
        total = self.hits + self.fails
        return PRIOR_ACCEPTANCE if total < 1 else max(PRIOR_ACCEPTANCE, self.hits / total)

    def start_step(self, running: Sequence[Request], num_waiting: int = 0) -> None:
        """Plan the step's proposals for the decoding requests among `running`, with
        `num_waiting` more requests about to join them."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prior = self.acceptance
        caps, acceptance, catch_up, upfront, starts = [], [], [], [], []
        for request in decoding:
            state = request.spec
            if state is None:
                state = request.spec = SpecState()
            caps.append(self.candidates(request, state) if state.take_turn() else 0)
            acceptance.append(state.acceptance(prior))
            starts.append(self._draft_prefills(request, state))
            rows, seconds = self._draft_catch_up(
                request, state, acceptance[-1], caps[-1], starts[-1]
            )
            catch_up.append(rows)
            upfront.append(seconds)
        self.num_plans += 1
        self.step_plan, self.step_accepted, self.step_draft_seconds = None, 0, 0.0
        self.step_size, self.step_context = len(decoding), sum(r.num_tokens for r in decoding)
        self.step_context_moved = self._context_moved()
        if not decoding:
            self.planned = {}
            return
        # The requests still in their prompt, or waiting to start it, decode a few steps
        # on: planned as decoding already, without proposals, so that a batch that is
        # filling up does not start proposals (and a draft's prefills) that pay only while
        # it is small.
        filling = len(running) - len(decoding) + num_waiting
        proposals = self._plan(acceptance, caps, catch_up, upfront, filling)
        starting = any(c and start for c, start in zip(proposals.counts, starts, strict=False))
        is_learning = self.hits + self.fails < 1
        expected = (proposals.gain or 0.0) * self.delivered.get(len(decoding) + filling, 1.0)
        if (
            starting
            and not is_learning
            and (self.step_context_moved or expected < DRAFT_START_GAIN)
        ):
            caps = [0 if start else cap for cap, start in zip(caps, starts, strict=True)]
            proposals = self._plan(acceptance, caps, catch_up, upfront, filling)
        counts = proposals.counts[: len(decoding)]
        size, gain = len(decoding), proposals.gain
        if not filling and any(counts) and gain is not None:
            if self._measures_plain(size, gain) or not self._is_trusted(size, gain):
                counts = [0] * size
            else:
                self.step_plan = (size, size + sum(counts), gain)
                self.verified_at[size] = self.num_plans
        self.planned = {id(r): c for r, c in zip(decoding, counts, strict=True) if c}

    def _plan(
        self,
        acceptance: list[float],
        caps: list[int],
        catch_up: list[int],
        upfront: list[float],
        filling: int,
    ) -> Plan:
        """`plan` for the decoding requests, and `filling` more without proposals."""
        return plan(
            acceptance + [0.0] * filling,
            caps + [0] * filling,
            self.step_cost,
            self.draft_cost,
            catch_up + [1] * filling,
            upfront + [0.0] * filling,
        )

    def _is_trusted(self, size: int, gain: float) -> bool:
        """Whether a plan for `size` decoding requests expecting `gain` runs: its expectation
        times what its size's plans delivered beats no proposals, or the size has not
        verified for EXPLORE_STEPS steps (DELIVERED_WEIGHT)."""
        if gain * self.delivered.get(size, 1.0) >= 1 + MIN_IMPROVEMENT:
            return True
        return self.num_plans - self.verified_at.get(size, 0) > EXPLORE_STEPS

    def _measures_plain(self, size: int, gain: float) -> bool:
        """Whether this step, of `size` decoding requests, runs without the proposals planned
        (expecting `gain`) to measure again what it costs so (EXPLORE_STEPS; CONTEXT_MOVED
        whatever the gain)."""
        if self.step_context_moved:
            return True
        if gain >= EXPLORE_BELOW_GAIN:
            return False
        measured = self.measured_at.get(size)
        stale = measured is None or self.num_plans - measured > EXPLORE_STEPS
        return stale or not self.step_cost.is_settled(size)

    def _context_moved(self) -> bool:
        """Whether the plain step of this step's size was last measured over contexts
        other enough from this step's to cost otherwise (CONTEXT_MOVED)."""
        last, now = self.plain_context.get(self.step_size), self.step_context
        if last is None:
            return False
        low, high = min(last, now), max(last, now)
        return high >= CONTEXT_TOKENS and high > CONTEXT_MOVED * low

    def candidates(self, request: Request, state: SpecState) -> int:
        """How many tokens the method could propose for `request` this step."""
        return self.max_k

    def _draft_catch_up(
        self, request: Request, state: SpecState, acceptance: float, cap: int, prefills: bool
    ) -> tuple[int, float]:
        """What the draft model's first forward for `request` this step costs besides its
        one sequence: the tokens it has not seen, as decode sequences when few (the last
        step's accepted ones: spec/draft.py), else as a prefill at the draft's measured
        seconds per token. A prefill (the prompt, or what a request gained while it did
        not propose) lets the draft propose for the rest of the request, so a step is
        charged the share of the tokens it may gain (at most `cap` proposals at
        `acceptance`) in those the request may still produce."""
        draft = self.draft_cost
        if draft is None:
            return 1, 0.0
        missing = request.num_tokens - state.num_draft_computed
        if not prefills:  # few enough for decode sequences (`_draft_prefills`)
            return missing, 0.0
        per_token = draft.prefill_token_seconds or 0.0
        remaining = request.sampling_params.max_tokens - request.num_output_tokens
        gained = sum(acceptance**j for j in range(cap + 1))
        return 1, per_token * missing * min(1.0, gained / max(1, remaining))

    def _draft_prefills(self, request: Request, state: SpecState) -> bool:
        """Whether proposing for `request` now needs a prefill of the draft model's
        (DRAFT_START_GAIN): its prompt, or more tokens than a verifying step keeps."""
        if self.draft_cost is None:
            return False
        seen = state.num_draft_computed
        return not seen or request.num_tokens - seen > self.max_k + 1

    def slots(self, request: Request, limit: int) -> int:
        """How many proposed tokens `request`, decoding, verifies this step: as planned,
        within `limit` (what its budget, context and max_tokens leave)."""
        return max(0, min(self.planned.get(id(request), 0), limit))

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        """Fill the chunks' `draft_token_ids` (at most `num_spec_slots` each) and lengthen
        them by as many, for the engine's step `step_id`."""
        raise NotImplementedError

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        if request.spec is not None and proposed > 0:
            request.spec.observe(proposed, accepted)
            self.hits = DECAY * self.hits + accepted
            self.fails = DECAY * self.fails + (accepted < proposed)
            self.step_accepted += accepted

    def observe_step(self, num_sequences: int, seconds: float) -> None:
        """A decode-only step of `num_sequences` sequences took `seconds` (proposing
        excluded)."""
        is_plain = self.step_plan is None and num_sequences == self.step_size
        if is_plain and self.step_context_moved:
            self.step_cost.restart(num_sequences, seconds)
        else:
            self.step_cost.observe(num_sequences, seconds)
        if is_plain:
            self.plain_context[num_sequences] = self.step_context
        self.measured_at[num_sequences] = self.num_plans
        if self.step_plan is None:
            return
        size, planned, expected = self.step_plan
        if num_sequences != planned:  # slots cut (a budget, max_tokens): not the plan's step
            return
        plain = self.step_cost.predict(size)
        if plain:  # tokens per second delivered, over a plain step's
            spent = seconds + self.step_draft_seconds
            delivered = (size + self.step_accepted) / spent / (size / plain)
            old = self.delivered.get(size, 1.0)
            self.delivered[size] = old + DELIVERED_WEIGHT * (delivered / expected - old)


class NgramSpeculator(Speculator):
    """Prompt lookup (spec/ngram.py): no second model, nothing to compute but a search,
    made when the step is planned (its length caps the request's proposals)."""

    method = SpeculativeMethod.NGRAM

    def candidates(self, request: Request, state: SpecState) -> int:
        config = self.config
        tokens = state.history.sync(request)
        state.candidates = lookup(tokens, config.ngram_min, config.ngram_max, self.max_k)
        return len(state.candidates)

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        for chunk in chunks:
            state = chunk.request.spec
            if not chunk.num_spec_slots or state is None:
                continue
            drafts = state.candidates[: chunk.num_spec_slots]
            chunk.draft_token_ids = drafts
            chunk.num_tokens += len(drafts)


def make_speculator(config: SpeculativeConfig) -> Speculator | None:
    """The configured method's speculator (None: speculation is off). The draft model's is
    built by the engine core's builder, which loads the model (spec/draft.py)."""
    if config.speculative_method == SpeculativeMethod.NGRAM:
        return NgramSpeculator(config)
    return None
