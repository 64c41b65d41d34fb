"""Structured output: `response_format` json_object / json_schema, enforced token by token.

The grammar engine is llguidance (Microsoft's, the Rust core of Guidance; vLLM and SGLang use
it too): one 3 MB wheel without dependencies (xgrammar 0.2 pulls triton and apache-tvm-ffi),
a grammar builds in about a millisecond, each next-token mask is computed lazily (~100 µs on
this CPU for a nested schema, bounded by the parser limits below), and it says what is wrong
with a schema in words a client can act on.

Where each part runs:
- the front end (`check`, in its tokenizer thread): the schema is valid for llguidance, or
  the request is a 400 naming the problem; nothing reaches the engine that cannot compile;
- the engine core (`GrammarCompiler`): each request's grammar is built in one background
  thread (never in the step loop) from a cache keyed by the spec; the request is scheduled
  once its grammar is ready, and keeps its own matcher (`RequestGrammar`, on `Request`);
- each step the core computes the sampled rows' masks (`fill_bitmasks`) into
  `ModelInput.grammar_bitmask`; the sampling rank bans every token outside them
  (`model/sampler.apply_grammar`); each sampled token advances the matcher
  (`Request.append_token`), and a grammar that is complete finishes its request ("stop").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from otel_engine.errors import RequestError
from otel_engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

PARAM = "response_format"
MAX_ERROR_CHARS = 500  # of llguidance's message in a 400
CACHE_SIZE = 32  # compiled grammars kept by the engine core (their lexers grow with use)
# JSON as models write it, with whitespace bounded: unbounded whitespace lets a small model
# fill max_tokens with newlines and never close the object.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}
# llguidance's defaults, except that errors stay short (verbose ones quote parser state).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """The engine's spec for an OpenAI `response_format` (None: plain text); RequestError
    with `param` for a shape that is not one."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise RequestError(
            "response_format type must be text, json_object or json_schema",
            code="invalid_value",
            param=PARAM,
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema must be an object with a schema",
            code="invalid_value",
            param=PARAM,
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(
            "response_format.json_schema.schema must be a JSON object",
            code="invalid_value",
            param=PARAM,
        )
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    structured = StructuredOutput("json_schema", text)
    structured.validate()
    return structured


def grammar_of(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (its JSON text)."""
    schema = spec.json_schema if spec.type == "json_schema" else '{"type":"object"}'
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def check(spec: StructuredOutput) -> None:
    """Raise RequestError (400, `response_format`) when llguidance cannot build `spec`'s
    grammar. A few milliseconds at most; cached per spec."""
    spec.validate()
    error = _grammar_error(spec)
    if error:
        raise RequestError(
            f"invalid JSON schema: {error[:MAX_ERROR_CHARS]}", code="invalid_value", param=PARAM
        )


@lru_cache(maxsize=64)
def _grammar_error(spec: StructuredOutput) -> str:
    try:
        grammar = grammar_of(spec)
    except ValueError as error:
        return str(error)
    return str(llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS))


def invalid_json_reason(text: str, finish_reason: str | None, stop_reason: object) -> str | None:
    """Why a structured-output choice's text is not valid JSON (`length`: max_tokens cut
    it; `stop_string`: a stop string did; `invalid`: it ended otherwise, which is a bug),
    or None when it is valid."""
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    if finish_reason == "length":
        return "length"
    return "stop_string" if isinstance(stop_reason, str) else "invalid"


class RequestGrammar:
    """One request's position in its grammar."""

    __slots__ = ("error", "matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the mask's width, in tokens
        self.error: str | None = None

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; True when the grammar is complete (the output is
        whole and only EOS could follow). A token the grammar refuses (an engine bug, or a
        parser limit reached) leaves `error` set."""
        matcher = self.matcher
        if not matcher.consume_token(token_id) or matcher.is_error():
            self.error = matcher.get_error() or "token refused"
            return False
        return bool(matcher.is_stopped())


def fill_bitmasks(grammars: Sequence[RequestGrammar]) -> bytes:
    """The next-token masks of `grammars`, one row of ceil(vocab_size / 32) int32 words each
    (bit b of word w allows token 32 w + b). One after the other: llguidance's parallel
    executor took 8x longer here (0.8 ms for 8 masks), its threads competing with torch's
    on two cores, than computing them in turn (~13 µs each)."""
    num_words = (grammars[0].vocab_size + 31) // 32
    rows = np.full((len(grammars), num_words), -1, dtype=np.int32)
    for index, grammar in enumerate(grammars):
        llguidance.numpy.fill_next_token_bitmask(grammar.matcher, rows, index)
    return rows.tobytes()


class GrammarCompiler:
    """The engine core's grammars: built in the `grammar` thread, cached per spec.

    The tokenizer's llguidance view (a token trie, ~1 s for a 49k vocabulary) is built on
    the first structured request, so a server that never sees one never pays for it.
    `compile_times` holds the seconds each build took, for the front end's histogram.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._thread: ThreadPoolExecutor | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self.compile_times: deque[float] = deque()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutput) -> Future[RequestGrammar]:
        """A fresh grammar for one request, built off the caller's thread; the future raises
        RequestError when the spec cannot be built."""
        with self._lock:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._thread.submit(self._grammar, spec)

    def _grammar(self, spec: StructuredOutput) -> RequestGrammar:
        template = self._cache.get(spec)
        if template is None:
            started = time.perf_counter()
            template = llguidance.LLMatcher(
                self._llg_tokenizer(), grammar_of(spec), log_level=0, limits=LIMITS
            )
            if template.is_error():
                error = template.get_error()
                raise RequestError(
                    f"invalid JSON schema: {error[:MAX_ERROR_CHARS]}",
                    code="invalid_value",
                    param=PARAM,
                )
            self.compile_times.append(time.perf_counter() - started)
            self._cache[spec] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return RequestGrammar(template.deep_copy(), self._llg_tokenizer().vocab_size)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            from otel_engine.model.loader import load_tokenizer

            started = time.perf_counter()
            hf_tokenizer = load_tokenizer(self.model_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer,  # type: ignore[arg-type]  # a fast tokenizer (load_tokenizer)
                n_vocab=max(self.vocab_size, len(hf_tokenizer)),
                eos_token=self.eos_token_ids or None,
            )
            seconds = round(time.perf_counter() - started, 3)
            logger.info("structured_output.tokenizer_ready", extra={"seconds": seconds})
        return self._tokenizer

    def take_compile_times(self) -> list[float]:
        times = self.compile_times
        return [times.popleft() for _ in range(len(times))]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
