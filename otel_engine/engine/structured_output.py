"""Structured output: `response_format` json_object / json_schema, enforced token by token.

The grammar engine is llguidance (Microsoft's, the Rust core of Guidance; vLLM and SGLang use
it too): one 3 MB wheel without dependencies (xgrammar 0.2 pulls triton and apache-tvm-ffi),
a grammar builds in about a millisecond, each next-token mask is computed lazily (~100 µs on
this CPU for a nested schema; the limits below bound what one schema may cost), and it says
what is wrong with a schema in words a client can act on.

Where each part runs:
- the front end (`check`, in its tokenizer thread): the schema is valid for llguidance and
  within MAX_PATTERN_REPEAT, or the request is a 400 naming the problem; nothing reaches the
  engine that cannot compile;
- the engine core (`GrammarCompiler`): each request's grammar is built in one background
  thread (never in the step loop) from a cache keyed by the spec; the request is scheduled
  once its grammar is ready, and keeps its own matcher (`RequestGrammar`, on `Request`);
- each step the core computes the sampled rows' masks (`fill_bitmasks`) into
  `ModelInput.grammar_bitmask`; the sampling rank bans every token outside them
  (`model/sampler.apply_grammar`); each sampled token advances the matcher
  (`Request.append_token`), and a grammar that is complete finishes its request (stop);
  each mask is timed and charged to its request's budgets (`RequestGrammar.fill`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import llguidance
import llguidance.numpy
import numpy as np

from otel_engine.errors import ErrorCode, RequestError
from otel_engine.memory import return_freed_memory
from otel_engine.observability.label_sets import InvalidJsonReason
from otel_engine.outputs import FinishReason
from otel_engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

PARAM = "response_format"
MAX_ERROR_CHARS = 500  # of llguidance's message in a 400
CACHE_SIZE = 32  # compiled grammars kept by the engine core (their lexers grow with use)
CACHE_MEMORY_BUDGET = 64 * 2**20  # what the cached grammars' masks may have taken, in all
KEEP_BYTES = 8 * 2**20  # a lexer grown past this leaves the cache when its last request ends
TRIM_BYTES = 2**20  # a request whose masks took more returns the heap's free memory at its end
REFUSED_SIZE = 256  # specs remembered as past a budget, refused at once
# JSON as models write it, with whitespace bounded: unbounded whitespace lets a small model
# fill max_tokens with newlines and never close the object.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}
# llguidance's defaults, except that errors stay short (verbose ones quote parser state).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# What one schema may cost (docs/operations.md, "Grammar limits"). A counted repeat costs
# mask time and lexer memory in proportion to its count (`^a{10000}$`: 2-6 ms a mask, 100000:
# 25-50 ms and ~36 MB), which llguidance's own limits do not bound: the front end refuses a
# pattern whose repeats, nested ones multiplied, exceed MAX_PATTERN_REPEAT.
MAX_PATTERN_REPEAT = 2_000
# Per request in the engine core: past either, that request alone fails (400, `param`
# response_format); masks of well-behaved schemas take 13 µs to 1 ms each.
MASK_TIME_BUDGET_S = 1.0  # seconds of mask computation over the request's life
MATCHER_MEMORY_BUDGET = 64 * 2**20  # bytes its masks may add to the process's RSS
LIMIT_EXCEEDED = ErrorCode.GRAMMAR_LIMIT_EXCEEDED  # the code of a request failed by a limit


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
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema must be an object with a schema",
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(
            "response_format.json_schema.schema must be a JSON object",
            code=ErrorCode.INVALID_VALUE,
            param=PARAM,
        )
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    structured = StructuredOutput("json_schema", text)
    structured.validate()
    return structured


def grammar_of(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (its JSON text)."""
    if spec.type == "tool_calls":
        return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar))
    schema = spec.json_schema if spec.type == "json_schema" else '{"type":"object"}'
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def check(spec: StructuredOutput) -> None:
    """Raise RequestError (400, `response_format`) when llguidance cannot build `spec`'s
    grammar. A few milliseconds at most; cached per spec."""
    spec.validate()
    error = _grammar_error(spec)
    if error:
        what = "the tools' grammar" if spec.type == "tool_calls" else "JSON schema"
        raise RequestError(
            f"invalid {what}: {error[:MAX_ERROR_CHARS]}",
            code=ErrorCode.INVALID_VALUE,
            param="tools" if spec.type == "tool_calls" else PARAM,
        )


@lru_cache(maxsize=64)
def _grammar_error(spec: StructuredOutput) -> str:
    if spec.type == "json_schema":
        repeats = max(
            (pattern_repeats(p) for p in _patterns(json.loads(spec.json_schema))), default=0
        )
        if repeats > MAX_PATTERN_REPEAT:
            return (
                f"a pattern repeats {repeats} times, more than max_pattern_repeat "
                f"({MAX_PATTERN_REPEAT}, nested repeats multiplied)"
            )
    try:
        grammar = grammar_of(spec)
    except ValueError as error:
        return str(error)
    return str(llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)) or _no_value(grammar)


class _ByteTokens:
    """A vocabulary of the 256 bytes and an EOS, enough to ask a grammar for its first
    bytes without the model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([byte]) for byte in range(256)] + [b"<eos>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()), slices=[])


def _no_value(grammar: str) -> str:
    """Why a grammar that builds matches no output at all (a schema that is only a `$ref`
    to itself, a `$defs` loop), or "": its matcher fails at the first mask."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=LIMITS)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return ""
    return "the schema matches no JSON value (a $ref that only refers to itself?)"


def _patterns(node: object) -> Iterator[str]:
    """Every regex in a schema: `pattern` values and `patternProperties` keys, at any depth."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack += item
        elif isinstance(item, dict):
            pattern = item.get("pattern")
            if isinstance(pattern, str):
                yield pattern
            properties = item.get("patternProperties")
            if isinstance(properties, dict):
                yield from (key for key in properties if isinstance(key, str))
            stack += item.values()


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_repeats(pattern: str) -> int:
    """The most copies of one atom that `pattern`'s counted repeats ask for: `{n}`, `{m,}`
    (m) and `{m,n}` (n), a repeated group multiplying what is inside it; `*`, `+` and `?`
    count once (they loop in the automaton instead of unrolling)."""
    stack = [[1, 1]]  # per open group: the most copies inside so far, those of the last atom
    index = 0
    while index < len(pattern):
        char = pattern[index]
        frame = stack[-1]
        counted = _COUNTED.match(pattern, index) if char == "{" else None
        if counted:
            upper = counted.group(2)
            frame[1] *= int(upper if upper else counted.group(1))
            index = counted.end()
        elif char == "(":
            stack.append([1, 1])
            index += 1
            continue
        elif char == ")" and len(stack) > 1:
            inner = stack.pop()
            stack[-1][1] = max(inner)
            index += 1
            continue
        else:
            frame[1] = 1
            index = _atom_end(pattern, index)
        frame[0] = max(frame)
    return max(max(frame) for frame in stack)


def _atom_end(pattern: str, index: int) -> int:
    """Where the atom at `index` ends: past an escape or a character class."""
    if pattern[index] == "\\":
        return index + 2
    if pattern[index] != "[":
        return index + 1
    index += 2 if pattern.startswith("[^", index) else 1
    index += 1  # a `]` first in a class is a member
    while index < len(pattern) and pattern[index] != "]":
        index += 2 if pattern[index] == "\\" else 1
    return index + 1


def invalid_json_reason(
    text: str, finish_reason: FinishReason | None, stop_reason: object
) -> InvalidJsonReason | None:
    """Why a structured-output choice's text is not valid JSON, or None when it is valid."""
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    if finish_reason == FinishReason.LENGTH:
        return InvalidJsonReason.LENGTH
    if isinstance(stop_reason, str):
        return InvalidJsonReason.STOP_STRING
    return InvalidJsonReason.INVALID


class RequestGrammar:
    """One request's position in its grammar, and what its masks have cost so far.

    `limit` names the budget the request went past (`mask_time`, `matcher_memory`, or
    `parser`: llguidance's own limits stopped a mask); `error` is then set too, and the
    request fails with LIMIT_EXCEEDED at its next token.
    """

    __slots__ = (
        "error",
        "last_mask_s",
        "limit",
        "mask_seconds",
        "matcher",
        "memory_bytes",
        "template",
        "vocab_size",
    )

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, template: _Template | None = None
    ) -> None:
        self.matcher = matcher
        self.template = template  # the cache's entry, which shares its lexer
        self.vocab_size = vocab_size  # the mask's width, in tokens
        self.error: str | None = None
        self.limit: str | None = None
        self.mask_seconds = 0.0  # over the request's life: MASK_TIME_BUDGET_S
        self.last_mask_s = 0.0  # this step's mask (0: none computed)
        self.memory_bytes = 0  # RSS its masks added: MATCHER_MEMORY_BUDGET

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; True when the grammar is complete (the output is
        whole and only EOS could follow). A token the grammar refuses (an engine bug, or a
        parser limit reached) leaves `error` set; a grammar already failed accepts nothing."""
        matcher = self.matcher
        if self.error is not None:
            return False
        if not matcher.consume_token(token_id) or matcher.is_error():
            self.error = matcher.get_error() or "token refused"
            return False
        return bool(matcher.is_stopped())

    def fill(self, rows: np.ndarray, index: int) -> None:
        """Compute the next-token mask into `rows[index]` and charge its cost to the
        request's budgets. Past one, the row allows every token (the request fails anyway)."""
        self.last_mask_s = 0.0
        template = self.template
        if self.error is None and template is not None and template.limit is not None:
            self._exceed(template.limit, "another request with this schema went past it")
        if self.error is not None:
            return
        rss = _rss_bytes()
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(self.matcher, rows, index)
        self.last_mask_s = time.perf_counter() - started
        self.mask_seconds += self.last_mask_s
        grown = max(0, _rss_bytes() - rss)
        self.memory_bytes += grown
        if template is not None:
            template.memory_bytes += grown
        if self.matcher.is_error():
            self._exceed("parser", "a parser limit stopped its mask")
        elif self.mask_seconds > MASK_TIME_BUDGET_S:
            self._exceed("mask_time", f"its masks took more than {MASK_TIME_BUDGET_S} s")
        elif self.memory_bytes > MATCHER_MEMORY_BUDGET:
            self._exceed(
                "matcher_memory", f"its masks took more than {MATCHER_MEMORY_BUDGET >> 20} MiB"
            )
        if self.error is not None:
            rows[index] = -1

    def _exceed(self, limit: str, why: str) -> None:
        self.limit = limit
        if self.template is not None:
            self.template.limit = limit
        self.error = f"the response_format grammar is too costly: {why} ({limit} budget)"


def fill_bitmasks(grammars: Sequence[RequestGrammar]) -> bytes:
    """The next-token masks of `grammars`, one row of ceil(vocab_size / 32) int32 words each
    (bit b of word w allows token 32 w + b), each timed (`RequestGrammar.fill`). One after
    the other: llguidance's parallel executor took 8x longer here (0.8 ms for 8 masks), its
    threads competing with torch's on two cores, than computing them in turn (~13 µs each)."""
    num_words = (grammars[0].vocab_size + 31) // 32
    rows = np.full((len(grammars), num_words), -1, dtype=np.int32)
    for index, grammar in enumerate(grammars):
        grammar.fill(rows, index)
    return rows.tobytes()


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@lru_cache(maxsize=1)
def _statm() -> int:
    return os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)  # kept open: reread


def _rss_bytes() -> int:
    """This process's resident set, from /proc/self/statm (an open descriptor: ~2 µs)."""
    return int(os.pread(_statm(), 64, 0).split()[1]) * _PAGE_SIZE


class _Template:
    """A compiled grammar in the cache, and what its requests' masks charged to it: the
    lexer states they build are shared by the template and every copy of it."""

    __slots__ = ("limit", "matcher", "memory_bytes", "num_live")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.memory_bytes = 0
        self.limit: str | None = None  # a budget one of its requests went past
        self.num_live = 0  # requests with a copy that have not ended (grammar thread only)


class GrammarCompiler:
    """The engine core's grammars: built in the `grammar` thread, cached per spec.

    `start` builds the tokenizer's llguidance view (a token trie, 0.4 s for a 49k
    vocabulary) in that thread, while the ranks load the model; the engine core waits for it
    before it is ready.
    The lexer states that masks build are shared by a spec's template and its copies, so
    the cache is what holds a costly grammar's memory: a spec whose request went past a
    budget leaves it and is refused (400) from then on, one whose lexer outgrew KEEP_BYTES
    leaves it when its last request ends (`release`), and the least recent leave once all
    have charged CACHE_MEMORY_BUDGET. Memory freed so is returned to the system
    (`malloc_trim`: glibc keeps it otherwise).
    `compile_times` holds the seconds each build took, for the front end's histogram.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._thread: ThreadPoolExecutor | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._trie: Future[llguidance.LLTokenizer] | None = None
        self._cache: OrderedDict[StructuredOutput, _Template] = OrderedDict()
        self._refused: OrderedDict[StructuredOutput, str] = OrderedDict()
        self.compile_times: deque[float] = deque()
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            return self._thread

    def start(self) -> Future[llguidance.LLTokenizer]:
        """Build the token trie now, in the grammar thread (requests queue behind it); the
        same future each time."""
        executor = self._executor()
        with self._lock:
            if self._trie is None:
                self._trie = executor.submit(self._llg_tokenizer)
            return self._trie

    def submit(self, spec: StructuredOutput) -> Future[RequestGrammar]:
        """A fresh grammar for one request, built off the caller's thread; the future raises
        RequestError when the spec cannot be built or went past a budget before."""
        return self._executor().submit(self._grammar, spec)

    def release(self, grammar: RequestGrammar) -> Future[None] | None:
        """A request with `grammar` ended: evict what is over budget, return memory (in the
        grammar thread; the future is done when it is; None after `shutdown`)."""
        try:
            return self._executor().submit(self._release, grammar)
        except RuntimeError:  # shut down: the process is ending
            return None

    def _release(self, grammar: RequestGrammar) -> None:
        template = grammar.template
        if template is not None:
            template.num_live -= 1
        if self._evict() or grammar.memory_bytes > TRIM_BYTES:
            return_freed_memory()

    def _grammar(self, spec: StructuredOutput) -> RequestGrammar:
        refused = self._refused.get(spec)
        if refused is not None:
            raise RequestError(refused, code=LIMIT_EXCEEDED, param=PARAM)
        template = self._cache.get(spec)
        if template is None:
            started = time.perf_counter()
            matcher = llguidance.LLMatcher(
                self._llg_tokenizer(), grammar_of(spec), log_level=0, limits=LIMITS
            )
            if matcher.is_error():
                error = matcher.get_error()
                raise RequestError(
                    f"invalid JSON schema: {error[:MAX_ERROR_CHARS]}",
                    code=ErrorCode.INVALID_VALUE,
                    param=PARAM,
                )
            self.compile_times.append(time.perf_counter() - started)
            template = self._cache[spec] = _Template(matcher)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        template.num_live += 1
        return RequestGrammar(
            template.matcher.deep_copy(), self._llg_tokenizer().vocab_size, template
        )

    def _evict(self) -> bool:
        """Drop the specs whose requests went past a budget (remembered, to refuse), those
        whose lexer outgrew KEEP_BYTES once no request uses them, then the least recent
        while the cache holds more than CACHE_MEMORY_BUDGET; True when any went."""
        num_cached = len(self._cache)
        for spec, template in list(self._cache.items()):
            if template.limit is not None:
                self._refused[spec] = (
                    f"the response_format grammar is too costly ({template.limit} budget "
                    "exceeded by an earlier request with this schema)"
                )
                if len(self._refused) > REFUSED_SIZE:
                    self._refused.popitem(last=False)
            if template.limit is not None or (
                template.num_live <= 0 and template.memory_bytes > KEEP_BYTES
            ):
                del self._cache[spec]
        while len(self._cache) > 1 and self.cache_memory_bytes > CACHE_MEMORY_BUDGET:
            self._cache.popitem(last=False)
        return len(self._cache) < num_cached

    @property
    def cache_memory_bytes(self) -> int:
        return sum(template.memory_bytes for template in self._cache.values())

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            started = time.perf_counter()
            self._tokenizer = self._build_trie()
            seconds = round(time.perf_counter() - started, 3)
            logger.info("structured_output.tokenizer_ready", extra={"seconds": seconds})
        return self._tokenizer

    def _build_trie(self) -> llguidance.LLTokenizer:
        """llguidance's view of the checkpoint's tokenizer: from its tokenizer.json by the
        Rust tokenizers library (0.4 s and ~38 MB for the default model; the same bytes and
        special tokens as through transformers, tested), else through transformers' fast
        tokenizer (2.3 s and ~136 MB, most of it transformers' tokenizer code)."""
        eos = self.eos_token_ids or None
        path = os.path.join(self.model_dir, "tokenizer.json")
        if os.path.isfile(path):
            import tokenizers

            size = tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
            return llguidance.LLTokenizer(path, n_vocab=max(self.vocab_size, size), eos_token=eos)
        from llguidance.hf import from_tokenizer

        from otel_engine.model.loader import load_transformers_tokenizer

        hf_tokenizer = load_transformers_tokenizer(self.model_dir)
        return from_tokenizer(
            hf_tokenizer,  # type: ignore[arg-type]  # a fast tokenizer
            n_vocab=max(self.vocab_size, len(hf_tokenizer)),
            eos_token=eos,
        )

    def take_compile_times(self) -> list[float]:
        times = self.compile_times
        return [times.popleft() for _ in range(len(times))]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
