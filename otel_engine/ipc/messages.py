"""Every type that crosses a process boundary. msgpack via msgspec; never pickle.

Frames between the front end (api_server / LLM) and the engine core, between the engine
core and its workers, and the ready handshake every child sends its parent. A fatal
failure anywhere becomes one `EngineDead` frame to the front end; a worker reports its own
failure as `WorkerFailure`. Value types with a home of their own travel inside these frames
and are imported from it: `SamplingParams` and `LogitsProcessing` (sampling_params.py),
`EngineLimits` (model/limits.py), `MemoryBandwidth` (model/bandwidth.py), `TokenLogprobs`
(outputs.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from otel_engine.model.bandwidth import MemoryBandwidth
from otel_engine.model.limits import EngineLimits
from otel_engine.outputs import FinishReason, TokenLogprobs
from otel_engine.sampling_params import LogitsProcessing, SamplingParams

# ---- Handshake: every child to its parent, once -------------------------------------------


class StackFrame(msgspec.Struct, frozen=True, array_like=True):
    """One frame of a thread's Python stack: where, never what (no locals, no source)."""

    file: str
    line: int
    function: str


class ErrorInfo(msgspec.Struct, frozen=True):
    """An exception flattened to strings, so it can cross any process boundary."""

    type: str
    message: str
    traceback: str = ""
    process: str = ""  # its name: "engine_core", "otel-worker-1" (ipc/process.process_title)
    # Where it is known to have failed, built from stack frames only (no message text), so
    # safe to show clients: "rank 1 hung in maybe_inject at otel_engine/...py:118".
    location: str = ""
    # A process that died of a signal faulthandler catches: its name ("SIGSEGV") and the
    # faulting thread's innermost frames, innermost first (`ipc/native_fault.py`).
    signal: str = ""
    frames: list[StackFrame] = []
    rank: int | None = None  # the worker's rank, when a worker failed


class Ready(msgspec.Struct, frozen=True, tag="ready", array_like=True):
    """The child finished starting. The engine core says what its limits are and every
    rank's fast-path plan (`executor/rank_plans.py`); a worker, the plan it chose
    (`FastPaths.summary()`, plain data). Rank 0 (and the engine core, from it) also says the
    memory read bandwidth it measured (`model/bandwidth.py`; None elsewhere)."""

    process: str
    pid: int
    limits: EngineLimits | None = None
    fast_paths: dict[str, Any] | None = None
    memory_bandwidth: MemoryBandwidth | None = None


class Failed(msgspec.Struct, frozen=True, tag="failed", array_like=True):
    """The child could not start; the parent re-raises this as EngineStartupError."""

    error: ErrorInfo


HandshakeMessage = Ready | Failed

# ---- Front end -> engine core ------------------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True, tag="add", array_like=True):
    """A new request, sent once in full. `trace_context` is W3C traceparent/tracestate.

    `output_token_ids`: the tokens an engine that died had already sent for it (a request
    carried over to the restarted engine, `engine/recovery.py`); they count as output, as
    after a preemption, and the request goes on from there."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    trace_context: dict[str, str] = {}
    output_token_ids: list[int] = []


class AbortRequests(msgspec.Struct, frozen=True, tag="abort", array_like=True):
    """Stop these requests now (client gone, stop string matched) and free their blocks."""

    request_ids: list[str]


class PauseRequests(msgspec.Struct, frozen=True, tag="pause", array_like=True):
    """Their clients stopped reading: free their slots and KV blocks until resumed."""

    request_ids: list[str]


class ResumeRequests(msgspec.Struct, frozen=True, tag="resume", array_like=True):
    """Their clients read again: queue them (they are recomputed when scheduled)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown", array_like=True):
    """Orderly stop of the engine core and its workers."""


CoreRequest = AddRequest | AbortRequests | PauseRequests | ResumeRequests | Shutdown

# ---- Engine core -> front end -----------------------------------------------------------


class RequestRejected(msgspec.Struct, frozen=True, array_like=True):
    """Why the engine core refused one request (the client's fault: HTTP 400), or, with
    `is_server_error`, could not go on with it (HTTP 500, e.g. its output could no longer
    follow its grammar). The rest of the engine is not affected."""

    code: str
    message: str
    param: str | None = None
    is_server_error: bool = False


class RequestUpdate(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one request in one step; `finish_reason` set on its last update.
    `rejected` is set (with `FinishReason.ABORT`) when the core refused the request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0  # so far, cumulative
    queue_time_s: float | None = None  # arrival to first scheduled; on the first update only
    rejected: RequestRejected | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache; first only
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 2..n; first update only
    # Speculative decoding: the proposed tokens this step verified for the request, and how
    # many of them it kept (`new_token_ids` then has that many more than one).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class StepOutputs(msgspec.Struct, frozen=True, tag="outputs", array_like=True):
    """The results of one engine step, plus the scheduler's state for metrics.

    One frame per step. `step_id` 0 is no step: the scheduler's state changed between steps
    (requests refused, aborted or paused), and the gauges must show it.
    """

    step_id: int
    updates: list[RequestUpdate]
    num_running: int = 0
    num_waiting: int = 0
    num_paused: int = 0
    kv_cache_usage: float = 0.0  # blocks held by requests (cached free blocks not counted)
    kv_cache_cached_blocks: int = 0  # free blocks that still hold a cached prefix
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since the last
    prefix_cache_hits: int = 0  # frame, and how many of them were found
    num_preemptions: int = 0  # preemptions during this step
    num_scheduled_seqs: int = 0
    num_scheduled_tokens: int = 0
    step_duration_s: float = 0.0
    grammar_compile_s: list[float] = []  # structured-output grammars built since the last frame
    grammar_mask_s: float = 0.0  # this step's grammar masks: a slow step says why
    num_grammar_deferred: int = 0  # structured requests that sat this step out (mask budget)
    # A step of decodes only: the bytes rank 0 read (model/step_reads.py) over the step's
    # time; 0 for any other step.
    decode_bandwidth: float = 0.0
    num_draft_tokens: int = 0  # proposed tokens this step verified (speculative decoding)
    num_accepted_tokens: int = 0  # of them, accepted
    num_verifications: int = 0  # requests that verified proposed tokens in this step


class EngineDead(msgspec.Struct, frozen=True, tag="dead", array_like=True):
    """The engine cannot continue. Every in-flight request fails with EngineDeadError.

    `trace_context` points at the failing step's span, so request spans can link to it.
    """

    error: ErrorInfo
    trace_context: dict[str, str] = {}
    # The request ids of the failing step's batch, when the core knew it (None: it died
    # without a word); the suspects of `engine/recovery.py`.
    batch: list[str] | None = None


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", array_like=True):
    """The engine core process is running: sent by its step-watchdog thread every
    `timing.HEARTBEAT_INTERVAL_S`, also while a step computes. A core that sends nothing
    (not even this) for `timing.HEARTBEAT_TIMEOUT_S` is frozen; the front end reports it."""


CoreOutput = StepOutputs | EngineDead | Heartbeat

# ---- Engine core -> workers (tensor parallel) ---------------------------------------------


class PromptLogprobsChunk(msgspec.Struct, frozen=True, array_like=True):
    """Sequence `seq_index` of the step wants the logprobs of the prompt tokens its chunk
    predicts: the logits of the chunk's first `num_targets` positions score the prompt token
    after each; `next_token_id` is the prompt token after the chunk when the last of those
    is not in the chunk (else -1)."""

    seq_index: int
    num_top: int
    num_targets: int
    next_token_id: int


class ModelInput(msgspec.Struct, frozen=True, tag="execute", array_like=True):
    """One step's batch, flattened: the same bytes go to every rank.

    Sequences are ordered decodes first. Per token: `input_ids`, `positions`,
    `slot_mapping`. Per sequence: `query_lens`, `seq_lens` (context after this step),
    `block_tables`. Per sampled sequence (rank 0 only uses these): `sample_indices`
    (sequence index), and the sampling fields. A decode that verifies k proposed tokens
    (speculative decoding) is k + 1 decode sequences of one token each, on the same blocks.
    """

    step_id: int
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decodes: int
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_indices: list[int]
    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int | None]
    output_positions: list[int]
    trace_context: dict[str, str] = {}  # the engine core's step span (workers' parent)
    # Per sampled row, or empty when no sequence of the step has any (the fast path).
    processing: list[LogitsProcessing | None] = []
    num_logprobs: list[int] = []  # top logprobs wanted (-1: no logprobs at all)
    prompt_logprobs: list[PromptLogprobsChunk] = []
    # Structured output: the sampled rows (indexes into `sample_indices`) that follow a
    # grammar, and their next-token masks, one row of int32 words each (bit b of word w
    # allows token 32 w + b; `engine/grammars.fill_bitmasks`).
    grammar_rows: list[int] = []
    grammar_bitmask: bytes = b""
    # The longest prompt of the batch's requests, only while the fault injector fires by
    # prompt length (`when=prompt_len>=N`; 0 otherwise).
    max_prompt_len: int = 0


class StopWorker(msgspec.Struct, frozen=True, tag="stop", array_like=True):
    """Leave the busy loop and exit cleanly."""


WorkerRequest = ModelInput | StopWorker

# ---- Workers -> engine core --------------------------------------------------------------


class ModelOutput(msgspec.Struct, frozen=True, tag="sampled", array_like=True):
    """Rank 0's sampled token per sampled sequence of step `step_id`, and their logprobs
    (per sampled sequence, None where not asked; empty when no sequence asked)."""

    step_id: int
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[list[TokenLogprobs]] = []  # one list per `ModelInput` chunk asked
    num_bytes_read: int = 0  # weights and KV cache rank 0's forward read (model/step_reads.py)


class WorkerFailure(msgspec.Struct, frozen=True, tag="worker_failure", array_like=True):
    """A worker's busy loop caught an exception; the engine core treats it as fatal.

    `failed_at` (wall clock) orders failures: when one rank's exception breaks a
    collective, its peers fail too, a moment later; the earliest is the cause.
    """

    rank: int
    error: ErrorInfo
    failed_at: float = 0.0


WorkerResponse = ModelOutput | WorkerFailure

# ---- Engine core <-> a worker's responder thread, after a step timeout ------------------


class RankReport(msgspec.Struct, frozen=True):
    """What a worker says of itself when the core asks after a step timeout.

    `last_enqueued_collective` / `last_completed_collective`: the sequence ids of its process
    group's collectives from PyTorch's Flight Recorder (-1: none yet, or no recorder);
    `last_collective`: the newest one's name (e.g. "gloo:all_reduce"); `step_id`: the step
    its busy loop is executing (None between steps); `stack`: its main thread, innermost
    frame last."""

    rank: int
    step_id: int | None
    last_enqueued_collective: int
    last_completed_collective: int
    last_collective: str
    stack: list[StackFrame]
    node: str = ""  # where the rank runs, on a Ray cluster ("127.0.0.1 (node 3f2a...)")
