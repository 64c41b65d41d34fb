"""The engine core's pure step: inputs -> scheduler -> executor -> outputs.

No sockets and no processes here: the core is given its executor (`core_proc.
build_engine_core` makes one), `core_proc.py` wraps it in a process with ZMQ, and
`core_client.InprocClient` calls it directly. One step path for both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import (
    is_decode,
    longest_prompt,
    prepare_model_input,
    sequence_chunks,
)
from otel_engine.engine.grammars import GrammarCompiler, RequestGrammar, fill_within
from otel_engine.engine.structured_output import LIMIT_EXCEEDED, PARAM, param_of
from otel_engine.engine.validation import check_request
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.executor.channel import failure_info
from otel_engine.executor.executor import Executor
from otel_engine.executor.hang import hang_error, ranks_part
from otel_engine.executor.rank_plans import runs_kernels
from otel_engine.ipc.messages import (
    AbortRequests,
    AddRequest,
    CoreRequest,
    EngineDead,
    ErrorInfo,
    ModelInput,
    ModelOutput,
    PauseRequests,
    RankReport,
    RequestRejected,
    RequestUpdate,
    ResumeRequests,
    StepOutputs,
    TokenLogprobs,
)
from otel_engine.ipc.process import ENGINE_CORE
from otel_engine.model.arch import ModelArch
from otel_engine.model.limits import EngineLimits
from otel_engine.observability import crash_delivery, crash_dump
from otel_engine.observability.decode_bandwidth import DecodeBandwidth
from otel_engine.observability.faults import FaultPhase, maybe_inject, wants_prompt_len
from otel_engine.observability.step_history import StepHistory, StepRecord
from otel_engine.observability.tracing import (
    get_tracer,
    inject_context,
    is_tracing,
    link_from,
    shutdown_telemetry,
)
from otel_engine.outputs import FinishReason
from otel_engine.sched.kv_cache import BlockAllocator
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from otel_engine.spec.speculator import Speculator, make_speculator
from otel_engine.timing import CRASH_FLUSH_S

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor; `step()` runs one batch."""

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        limits: EngineLimits,
        executor: Executor,
        model_dir: str = "",
        grammars: GrammarCompiler | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`grammars`: the structured-output compiler, its token trie begun (else one is
        made here, its trie built before this returns when there is a `model_dir`).
        `speculator`: speculative decoding's proposer (else the configured method's, when
        it needs no model of its own: spec/speculator.make_speculator)."""
        self.config = config
        self.arch = arch
        self.limits = limits
        self.eos_token_ids = frozenset(self.arch.eos_token_ids)
        self.speculator: Speculator | None = speculator or make_speculator(config.speculative)
        self.scheduler = Scheduler(
            BlockAllocator(
                self.limits.num_kv_blocks,
                config.cache.block_size,
                enable_prefix_caching=config.cache.enable_prefix_caching,
            ),
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=self.limits.max_model_len,
            speculation=self.speculator,
        )
        self.executor = executor
        self.fast_paths = executor.fast_paths  # every rank's plan (`executor/rank_plans.py`)
        self.memory_bandwidth = executor.memory_bandwidth  # rank 0's peak (model/bandwidth.py)
        self.bandwidth = DecodeBandwidth(self.memory_bandwidth)
        # Structured-output requests wait here, outside the scheduler, for their grammar.
        self.grammars = grammars or GrammarCompiler(model_dir, arch.vocab_size, arch.eos_token_ids)
        if model_dir:
            self._build_token_trie()
        self.compiling: dict[str, tuple[Request, futures.Future[RequestGrammar]]] = {}
        self.started_at = time.monotonic()
        self.last_step_at = self.started_at
        self.step_started_at: float | None = None  # read by the step watchdog thread
        self.last_step_started_at = self.started_at
        self.current_step_id = 0
        self.step_mask_s = 0.0  # the current step's grammar masks (engine/grammars.py)
        self.num_grammar_deferred = 0  # structured requests that sat the step out for it
        self.step_bytes_read = 0  # what the current step's forward read (model/step_reads.py)
        self.step_decode_bandwidth = 0.0  # its bytes over its time, for decodes alone
        self.step_num_drafts = 0  # proposed tokens the current step verifies
        self.step_propose_s = 0.0  # what proposing them took (a draft model's forwards)
        self._tracer = get_tracer()
        self.is_tracing = is_tracing()
        self.failed_step_context: dict[str, str] = {}
        self.current_output: SchedulerOutput | None = None  # the batch a crash dump shows
        self.current_model_input: ModelInput | None = None
        self.current_step_span: trace.Span | None = None
        self.crash_recorded = False
        self.history = StepHistory(config.observability.crash_history_steps)
        self.rank_reports: list[RankReport | None] = []  # asked after a step timeout
        logger.info(
            "engine.config",
            extra={
                "engine_config": crash_dump.engine_config_part(
                    config, self.arch, self.limits, self.fast_paths
                )
            },
        )

    def _build_token_trie(self) -> None:
        """Build llguidance's view of the tokenizer before the engine is ready, so that no
        request pays for it; one that fails is logged, and structured requests then fail
        alone (500) as they try again."""
        trie = self.grammars.start()
        error = trie.exception()
        if error is not None:
            logger.warning(
                "structured_output.tokenizer_failed", extra={"error_type": type(error).__name__}
            )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, message: AddRequest) -> RequestUpdate | None:
        """Queue a request; one the engine can never run is refused on its own, with the
        reason, and nothing else is affected."""
        try:
            if (
                message.request_id in self.scheduler.requests
                or message.request_id in self.compiling
            ):
                raise RequestError(
                    "request id is already in flight", code=ErrorCode.DUPLICATE_REQUEST
                )
            check_request(
                message.prompt_token_ids,
                message.sampling_params,
                vocab_size=self.arch.vocab_size,
                max_model_len=self.limits.max_model_len,
                limited_by=self.limits.limited_by,
                output_token_ids=message.output_token_ids,
            )
        except RequestError as error:
            logger.warning(
                "request.rejected", extra={"request_id": message.request_id, "code": error.code}
            )
            rejected = RequestRejected(error.code, error.message, error.param)
            return RequestUpdate(message.request_id, [], FinishReason.ABORT, rejected=rejected)
        request = Request(
            request_id=message.request_id,
            prompt_token_ids=message.prompt_token_ids,
            sampling_params=message.sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=message.arrival_time,
            trace_link=link_from(message.trace_context) if self.is_tracing else None,
            prompt_logprobs=[] if message.sampling_params.prompt_logprobs is not None else None,
            output_token_ids=list(message.output_token_ids),
        )
        structured = message.sampling_params.structured_output
        if structured is None:
            self.scheduler.add(request)
        else:
            self.compiling[request.request_id] = (request, self.grammars.submit(structured))
        return None

    @property
    def is_compiling(self) -> bool:
        return bool(self.compiling)

    def has_compiled(self) -> bool:
        return any(future.done() for _, future in self.compiling.values())

    def wait_compiled(self, timeout_s: float) -> None:
        """Block until a grammar is ready (or `timeout_s`): an engine with nothing else to
        do waits here instead of spinning."""
        if self.compiling:
            pending = [future for _, future in self.compiling.values()]
            futures.wait(pending, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)

    def admit_compiled(self) -> list[RequestUpdate]:
        """Schedule the requests whose grammar is ready; refuse those whose grammar cannot
        be built (their updates, to send)."""
        refused: list[RequestUpdate] = []
        if not self.compiling:
            return refused
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                request.grammar = _replayed(future.result(), request.output_token_ids)
            except RequestError as error:
                rejected = RequestRejected(error.code, error.message, error.param)
                refused.append(RequestUpdate(request_id, [], FinishReason.ABORT, rejected=rejected))
                continue
            except Exception as exc:  # llguidance failed: this request only
                logger.warning(
                    "structured_output.compile_failed",
                    extra={"request_id": request_id, "error_type": type(exc).__name__},
                )
                rejected = RequestRejected(
                    ErrorCode.REQUEST_FAILED,
                    f"structured output could not be set up: {type(exc).__name__}",
                    is_server_error=True,
                )
                refused.append(RequestUpdate(request_id, [], FinishReason.ABORT, rejected=rejected))
                continue
            self.scheduler.add(request)
        return refused

    def handle(self, message: CoreRequest) -> RequestUpdate | None:
        """Apply one message from the front end (not `Shutdown`, the shell's business);
        returns the update of a refused request."""
        scheduler = self.scheduler
        if isinstance(message, AddRequest):
            return self.add_request(message)
        if isinstance(message, AbortRequests):
            self._release_grammars(scheduler.abort(message.request_ids))
            for request_id in message.request_ids:
                _, future = self.compiling.pop(request_id, (None, None))
                if future is not None:
                    future.add_done_callback(self._release_compiled)
        elif isinstance(message, PauseRequests):
            scheduler.pause(message.request_ids)
        elif isinstance(message, ResumeRequests):
            scheduler.resume(message.request_ids)
        return None

    def state_outputs(self, updates: list[RequestUpdate] | None = None) -> StepOutputs:
        """A frame that is no step (`step_id` 0): refusals, and the scheduler's state."""
        return self._outputs(0, updates or [])

    def _outputs(self, step_id: int, updates: list[RequestUpdate], **step: Any) -> StepOutputs:
        scheduler = self.scheduler
        queried, hit = scheduler.allocator.take_stats()
        return StepOutputs(
            step_id=step_id,
            updates=updates,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_paused=scheduler.num_paused,
            kv_cache_usage=scheduler.allocator.usage,
            kv_cache_cached_blocks=scheduler.allocator.num_cached_blocks,
            prefix_cache_queries=queried,
            prefix_cache_hits=hit,
            grammar_compile_s=self.grammars.take_compile_times(),
            **step,
        )

    def step(self) -> StepOutputs:
        """Schedule, execute and update one batch."""
        return self.run(self.scheduler.schedule())

    def run(self, output: SchedulerOutput) -> StepOutputs:
        """Execute and update one scheduled batch (`_stepping` does the bookkeeping); `replay`
        hands it a batch rebuilt from a crash dump."""
        with self._stepping(output) as trace_context:
            maybe_inject(
                ENGINE_CORE,
                phase=FaultPhase.RUN,
                step=output.step_id,
                num_requests=len(output.chunks),
                num_tokens=output.num_batched_tokens,
                prompt_len=longest_prompt(output.chunks) if wants_prompt_len() else 0,
            )
            result = self._execute(output, trace_context)
            if result.prompt_logprobs:
                self._collect_prompt_logprobs(output, result)
            logprobs = _logprobs_by_request(output, result)
            drafts = {id(c.request): len(c.draft_token_ids) for c in output.chunks}
            updated = self.scheduler.update(output, result.sampled_token_ids)
            updates = [
                _update(r, logprobs.get(r.request_id), drafts.get(id(r), 0)) for r in updated
            ]
            num_accepted = sum(u.num_accepted_tokens for u in updates)
            if self.current_step_span is not None and self.step_num_drafts:
                self.current_step_span.set_attribute(
                    "otel_engine.step.num_accepted_tokens", num_accepted
                )
        self._release_grammars(r for r in updated if r.status.is_finished)
        self._record_step(output, num_accepted)
        return self._outputs(
            output.step_id,
            updates,
            num_draft_tokens=sum(u.num_draft_tokens for u in updates),
            num_accepted_tokens=num_accepted,
            num_verifications=sum(1 for u in updates if u.num_draft_tokens),
            num_preemptions=len(output.preempted_request_ids),
            num_scheduled_seqs=len(output.chunks),
            num_scheduled_tokens=output.num_batched_tokens,
            step_duration_s=self.last_step_at - self.last_step_started_at,
            grammar_mask_s=self.step_mask_s,
            num_grammar_deferred=self.num_grammar_deferred,
            decode_bandwidth=self.step_decode_bandwidth,
        )

    def _release_grammars(self, requests: Iterable[Request]) -> None:
        """Ended requests give their grammars back (the compiler returns the memory)."""
        for request in requests:
            if request.grammar is not None:
                self.grammars.release(request.grammar)

    def _release_compiled(self, future: futures.Future[RequestGrammar]) -> None:
        """A grammar built for a request aborted before it ran."""
        if not future.cancelled() and future.exception() is None:
            self.grammars.release(future.result())

    def _record_step(self, output: SchedulerOutput, num_accepted: int = 0) -> None:
        """The step in the crash history: plain numbers only (step_history.FIELDS)."""
        history = self.history
        if not history.size:
            return
        scheduler = self.scheduler
        allocator = scheduler.allocator
        chunks = output.chunks
        duration = self.last_step_at - self.last_step_started_at
        history.record(
            StepRecord(
                step_id=output.step_id,
                started_at=time.time() - duration,
                duration_s=duration,
                num_requests=len(chunks),
                num_prefill_chunks=sum(
                    1 for chunk in chunks if chunk.num_tokens > len(chunk.draft_token_ids) + 1
                ),
                num_scheduled_tokens=output.num_batched_tokens,
                num_preemptions=len(output.preempted_request_ids),
                kv_cache_usage=allocator.usage,
                num_cached_blocks=allocator.num_cached_blocks,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_paused=len(scheduler.paused),
                grammar_mask_s=self.step_mask_s,
                num_grammar_deferred=self.num_grammar_deferred,
                num_draft_tokens=self.step_num_drafts,
                num_accepted_tokens=num_accepted,
            )
        )

    def _execute(self, output: SchedulerOutput, trace_context: dict[str, str]) -> ModelOutput:
        self.step_num_drafts = 0
        self.step_propose_s = 0.0
        self.step_mask_s = 0.0
        self.num_grammar_deferred = 0
        self.step_bytes_read = 0
        if output.is_empty:
            return ModelOutput(output.step_id, [])
        if self.speculator is not None:
            self._propose(output)
        self._fill_masks(output)
        if self.speculator is not None:  # decodes (with their proposals) first
            output.chunks.sort(key=lambda c: not is_decode(c))
            self._tag_verification(output)
        model_input = self.current_model_input = prepare_model_input(
            output.step_id, output.chunks, self.config.cache.block_size, trace_context
        )
        result = self.executor.execute(model_input)
        self.step_bytes_read = result.num_bytes_read
        return result

    def _propose(self, output: SchedulerOutput) -> None:
        """Fill the step's proposed tokens (spec/speculator.py; the draft model runs
        here)."""
        assert self.speculator is not None
        started = time.monotonic()
        self.speculator.propose(output.chunks, output.step_id)
        self.step_propose_s = time.monotonic() - started
        self.step_num_drafts = sum(len(c.draft_token_ids) for c in output.chunks)

    def _tag_verification(self, output: SchedulerOutput) -> None:
        """The step span says what it verifies: its proposed tokens (after grammars cut
        theirs) and the positions it samples."""
        span = self.current_step_span
        if span is None or not self.step_num_drafts:
            return
        span.set_attribute("otel_engine.step.num_batched_tokens", output.num_batched_tokens)
        span.set_attribute("otel_engine.step.num_draft_tokens", self.step_num_drafts)
        span.set_attribute(
            "otel_engine.step.num_verified_positions",
            sum(c.num_sample_rows for c in output.chunks),
        )

    def _fill_masks(self, output: SchedulerOutput) -> None:
        """Compute this step's grammar masks within the step's budget (`fill_within`); a
        request left without one sits the step out: its chunk leaves the batch and is
        scheduled again next step. What the masks cost and how many waited go on the step
        span (and, through `step_mask_s` and `num_grammar_deferred`, into the step's metrics
        and history), so that a slow step says why."""
        rows = [(c, g) for c in output.chunks if c.needs_sample and (g := c.request.grammar)]
        if not rows:
            return
        self.step_mask_s = fill_within([grammar for _, grammar in rows])
        waiting = {id(chunk) for chunk, grammar in rows if grammar.num_deferred}
        if waiting:
            output.chunks = [c for c in output.chunks if id(c) not in waiting]
        self._fill_proposal_masks(rows, waiting)
        self.num_grammar_deferred = len(waiting)
        span = self.current_step_span
        if span is not None:
            # The batch that runs, as the step's metrics and history count it. The links to
            # the requests that sat the step out stay: a span's links are fixed at its start.
            span.set_attribute("otel_engine.step.num_requests", len(output.chunks))
            span.set_attribute("otel_engine.step.num_batched_tokens", output.num_batched_tokens)
            span.set_attribute("otel_engine.step.grammar_mask_s", self.step_mask_s)
            span.set_attribute("otel_engine.step.num_grammar_rows", len(rows) - len(waiting))
            span.set_attribute("otel_engine.step.num_grammar_deferred", len(waiting))

    def _fill_proposal_masks(
        self, rows: list[tuple[ScheduledChunk, RequestGrammar]], waiting: set[int]
    ) -> None:
        """The grammar masks of the positions after each proposed token of a structured
        request; its proposals stop at the first one its grammar refuses (it could never be
        accepted), and the step's drafts count shrinks by the rest."""
        for chunk, grammar in rows:
            drafts = chunk.draft_token_ids
            if not drafts or id(chunk) in waiting:
                continue
            allowed = grammar.fill_proposals(drafts)
            if allowed < len(drafts):
                chunk.num_tokens -= len(drafts) - allowed
                self.step_num_drafts -= len(drafts) - allowed
                chunk.draft_token_ids = drafts[:allowed]
                grammar.proposal_rows = grammar.proposal_rows[:allowed]

    def _collect_prompt_logprobs(self, output: SchedulerOutput, result: ModelOutput) -> None:
        """Keep each asking request's prompt logprobs in order; a chunk computed again after
        a preemption adds nothing it already has."""
        model_input = self.current_model_input
        assert model_input is not None
        chunk_of = sequence_chunks(output.chunks)
        for asked, entries in zip(model_input.prompt_logprobs, result.prompt_logprobs, strict=True):
            chunk = output.chunks[chunk_of[asked.seq_index]]
            collected = chunk.request.prompt_logprobs
            if collected is None:
                continue
            first_target = chunk.start + 1  # the prompt position the chunk's first entry scores
            skip = len(collected) + 1 - first_target
            if 0 <= skip < len(entries):
                collected += entries[skip:]

    @contextmanager
    def _stepping(self, output: SchedulerOutput) -> Iterator[dict[str, str]]:
        """Around one step: what the step watchdog and a crash dump read, the step span
        (`engine_core.step`, linked to the batch's request spans; yields its context for the
        workers), and on failure the crash record (the span ends with status ERROR, its
        context kept in `failed_step_context` for the `EngineDead` frame)."""
        self.last_step_started_at = self.step_started_at = time.monotonic()
        self.current_step_id = output.step_id
        self.current_output, self.current_model_input = output, None
        span = self.current_step_span = self._start_step_span(output) if self.is_tracing else None
        try:
            yield inject_context(trace.set_span_in_context(span)) if span else {}
        except Exception as exc:
            self.record_crash(failure_info(exc, ENGINE_CORE))
            raise
        finally:
            self.step_started_at = None
        self.last_step_at = time.monotonic()
        self._account_bandwidth(span)
        self._account_step_cost()
        if span is not None:
            span.end()
        self.current_step_span = None
        self.current_output = self.current_model_input = None

    def _account_step_cost(self) -> None:
        """A decode-only step's time by its sequences, proposing excluded: what speculative
        decoding plans with (spec/cost.py)."""
        model_input = self.current_model_input
        if self.speculator is None or model_input is None:
            return
        if model_input.num_decodes == len(model_input.query_lens):
            seconds = self.last_step_at - self.last_step_started_at - self.step_propose_s
            self.speculator.observe_step(model_input.num_decodes, seconds)

    def _account_bandwidth(self, span: trace.Span | None) -> None:
        """The step's reads over its time, for a step of decodes alone
        (`observability/decode_bandwidth.py`), on the step span with the bytes it read."""
        model_input = self.current_model_input
        is_decode_only = model_input is not None and model_input.num_decodes == len(
            model_input.query_lens
        )
        seconds = self.last_step_at - self.last_step_started_at
        bandwidth = self.bandwidth.of_step(self.step_bytes_read, seconds, is_decode_only)
        self.step_decode_bandwidth = bandwidth
        if span is None or not self.step_bytes_read:
            return
        span.set_attribute("otel_engine.step.bytes_read", self.step_bytes_read)
        if bandwidth:
            span.set_attribute("otel_engine.step.decode_bandwidth_bytes_per_second", bandwidth)
            ratio = self.bandwidth.ratio(bandwidth)
            if ratio is not None:
                span.set_attribute("otel_engine.step.decode_bandwidth_ratio", ratio)

    def _start_step_span(self, output: SchedulerOutput) -> trace.Span:
        links = [c.request.trace_link for c in output.chunks if c.request.trace_link is not None]
        span = self._tracer.start_span(
            "engine_core.step",
            links=links,
            attributes={
                "otel_engine.step.id": output.step_id,
                "otel_engine.step.num_requests": len(output.chunks),
                "otel_engine.step.num_batched_tokens": output.num_batched_tokens,
                "otel_engine.step.num_preemptions": len(output.preempted_request_ids),
            },
        )
        return span

    def hang_error(self, process: str) -> ErrorInfo:
        """The current step's timeout error, naming the hung rank at TP > 1: the workers
        are asked where they are (`executor/hang.py`); their answers go into the crash
        dump's `ranks` part. Called from the thread that gave up on the step."""
        self.rank_reports = self.executor.ask_ranks()
        return hang_error(self.current_step_id, self.config, process, self.rank_reports)

    def give_up_on_step(self, process: str) -> EngineDead:
        """The fatal end of a step that outlived --step-timeout, for both shells (the core
        process's watchdog and the in-process client): the timeout error naming the hung
        rank, its log line, the crash dump, the telemetry flush that gets the dump out
        first, the workers killed. Returns the `EngineDead` to hand to the front end."""
        info = self.hang_error(process)
        logger.error(
            "engine.step_timeout",
            extra={"step": self.current_step_id, "timeout_s": self.config.timeouts.step_timeout},
        )
        self.record_crash(info)
        shutdown_telemetry(timeout_s=CRASH_FLUSH_S)
        self.executor.kill()
        return EngineDead(
            error=info, trace_context=self.failed_step_context, batch=self.failed_batch()
        )

    def failed_batch(self) -> list[str] | None:
        """The request ids of the step that failed (none outside a step), for `EngineDead`:
        the suspects of a poison request (`engine/recovery.py`)."""
        output = self.current_output
        return [] if output is None else [chunk.request.request_id for chunk in output.chunks]

    def record_crash(self, info: ErrorInfo) -> None:
        """Build the crash dump of the current step and deliver it (span event and log, and
        the --crash-dump-dir file).

        Called on every fatal path before anything is torn down; never raises. Ends the
        step span (or a stand-alone `engine_core.crash` span outside a step) and keeps
        its context in `failed_step_context` for the `EngineDead` frame.
        """
        if self.crash_recorded:
            return
        self.crash_recorded = True
        try:
            span = self.current_step_span
            if span is None and self.is_tracing:
                span = self._tracer.start_span("engine_core.crash")
            failure = crash_delivery.failure_of(info)
            parts: dict[str, Callable[[], Any]] = {
                "scheduler_output": lambda: crash_dump.scheduler_output_part(
                    self.current_output,
                    self.current_model_input,
                    self.config.model.device,
                    kernels=runs_kernels(self.fast_paths),
                ),
                "engine_config": lambda: crash_dump.engine_config_part(
                    self.config, self.arch, self.limits, self.fast_paths
                ),
                "history": self.history.part,
                "system_stats": lambda: crash_dump.system_stats_part(
                    scheduler=self.scheduler,
                    started_at=self.started_at,
                    last_step_at=self.last_step_at,
                    failure=failure,
                    process_pids=self.executor.process_pids(),
                    memory_bandwidth=self.bandwidth.part(),
                ),
            }
            if self.rank_reports:
                parts["ranks"] = lambda: ranks_part(self.rank_reports)
            placement = self.executor.placement()
            if placement:  # ranks on other nodes (a Ray cluster): which rank ran where
                parts["placement"] = lambda: placement
            dump = crash_dump.build_dump(parts)
            crash_delivery.deliver(dump, span, failure, self.config, logger)
            if span is not None:
                self.failed_step_context = inject_context(trace.set_span_in_context(span))
                span.end()
            self.current_step_span = None
        except Exception:
            logger.exception("engine_crash_dump.failed")

    def shutdown(self, *, graceful: bool = True) -> None:
        self.grammars.shutdown()
        self.executor.shutdown(graceful=graceful)


def _replayed(grammar: RequestGrammar, output_token_ids: list[int]) -> RequestGrammar:
    """`grammar` advanced over the tokens a request carried over from an engine that died
    had already produced (`AddRequest.output_token_ids`): it goes on where it was. A token
    the grammar refuses is a failure of this request alone."""
    for token_id in output_token_ids:
        grammar.accept(token_id)
        if grammar.error is not None:
            raise RuntimeError("the grammar refused a carried-over token")
    return grammar


def _logprobs_by_request(
    output: SchedulerOutput, result: ModelOutput
) -> dict[str, list[TokenLogprobs | None]]:
    """The logprobs of each sampled request's rows of the step, by request id (none
    asked: {})."""
    if not result.logprobs:
        return {}
    found = {}
    position = 0
    for chunk in output.chunks:
        count = chunk.num_sample_rows
        if count:
            found[chunk.request.request_id] = result.logprobs[position : position + count]
        position += count
    return found


def _update(
    request: Request, logprobs: list[TokenLogprobs | None] | None = None, num_drafts: int = 0
) -> RequestUpdate:
    if request.grammar is not None and request.grammar.error is not None:
        return _grammar_failed(request)
    queue_time = num_cached = prompt_logprobs = None
    if request.num_output_tokens == request.num_new_tokens:  # its first update
        num_cached = request.num_cached_tokens
        prompt_logprobs = request.prompt_logprobs
        if request.first_scheduled_time is not None:
            queue_time = max(0.0, request.first_scheduled_time - request.arrival_time)
    count = request.num_new_tokens
    kept = [entry for entry in logprobs[:count] if entry is not None] if logprobs else None
    return RequestUpdate(
        request.request_id,
        request.output_token_ids[-count:] if count else [],
        request.finish_reason,
        request.stop_reason,
        request.num_preemptions,
        queue_time,
        num_cached_tokens=num_cached,
        logprobs=kept or None,
        prompt_logprobs=prompt_logprobs,
        num_draft_tokens=num_drafts,
        num_accepted_tokens=min(count - 1, num_drafts) if num_drafts else 0,
    )


def _grammar_failed(request: Request) -> RequestUpdate:
    """A request whose output can no longer follow its grammar fails on its own: 400 when
    its schema went past a budget (`grammar.limit`), else 500 (an engine bug)."""
    grammar = request.grammar
    assert grammar is not None
    logger.warning(
        "structured_output.failed",
        extra={
            "request_id": request.request_id,
            "num_output_tokens": request.num_output_tokens,
            "limit": grammar.limit,
            "mask_seconds": round(grammar.mask_seconds, 3),
            "matcher_memory_bytes": grammar.memory_bytes,
        },
    )
    spec = request.sampling_params.structured_output
    param = PARAM if spec is None else param_of(spec)
    if grammar.limit is not None and grammar.error is not None:
        rejected = RequestRejected(LIMIT_EXCEEDED, grammar.error, param)
        return RequestUpdate(request.request_id, [], FinishReason.ABORT, rejected=rejected)
    rejected = RequestRejected(
        ErrorCode.STRUCTURED_OUTPUT_FAILED,
        f"the output could not follow the {param} grammar",
        param,
        is_server_error=True,
    )
    return RequestUpdate(request.request_id, [], FinishReason.ABORT, rejected=rejected)
