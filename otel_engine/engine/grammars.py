"""The engine core's grammars: built, cached and shared per spec, one position and one mask
per request, and what their masks may cost.

- `GrammarCompiler`: each request's grammar is checked again (`structured_output.check`: the
  core refuses on its own what the front end would) and built in one background thread
  (never in the step loop) from a cache keyed by the spec; the request is scheduled once its
  grammar is ready, and keeps its own matcher (`RequestGrammar`, on `Request`);
- each step the core computes the sampled rows' masks (`fill_within`) within
  STEP_MASK_BUDGET_S, each grammar charged the time its masks take past its fair share, so
  a costly one waits more steps than cheap ones: a row left without one sits the step out;
  the masks travel in `ModelInput.grammar_bitmask` (`fill_bitmasks`), the sampling rank bans
  every token outside them (`model/sampler.apply_grammar`); each sampled token advances the
  matcher (`Request.append_token`), and a grammar that is complete finishes its request
  (stop); each mask is timed and charged to its request's budgets (`RequestGrammar.fill`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import llguidance
import llguidance.numpy
import numpy as np

from otel_engine.engine.grammar_bounds import GrammarLimit
from otel_engine.engine.structured_output import (
    LIMIT_EXCEEDED,
    LIMITS,
    MAX_ERROR_CHARS,
    check,
    grammar_of,
    is_limit_error,
    param_of,
)
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.memory import return_freed_memory
from otel_engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

CACHE_SIZE = 32  # compiled grammars kept by the engine core (their lexers grow with use)
CACHE_MEMORY_BUDGET = 64 * 2**20  # what the cached grammars' masks may have taken, in all
KEEP_BYTES = 8 * 2**20  # a lexer grown past this leaves the cache when its last request ends
TRIM_BYTES = 2**20  # a request whose masks took more returns the heap's free memory at its end
REFUSED_SIZE = 256  # specs remembered as past a budget, refused at once
# What grammars may cost (docs/operations.md, "Grammar limits"); what one schema may hold
# before it is built is engine/grammar_bounds.py's. Per request in the engine core: past
# either, that request alone fails (400, `param` response_format); masks of well-behaved
# schemas take 13 µs to 1 ms each.
MASK_TIME_BUDGET_S = 1.0  # seconds of mask computation over the request's life
MATCHER_MEMORY_BUDGET = 64 * 2**20  # bytes its masks may add to the process's RSS
# Per step, all requests together: masks are computed until they have taken this long, each
# grammar charged its mask time past its fair share of it (`fill_within`); the rest wait.
STEP_MASK_BUDGET_S = 0.02


class RequestGrammar:
    """One request's position in its grammar, its next-token mask, and what its masks have
    cost so far.

    `limit` names the budget the request went past (a GrammarLimit: `mask_time`,
    `matcher_memory`, or `parser`: llguidance's own limits stopped a mask or a token the
    mask allowed); `error` is then set too, and the request fails with LIMIT_EXCEEDED at its
    next token. An `error` without a `limit` is a token outside the mask: an engine bug.
    """

    __slots__ = (
        "debt_s",
        "error",
        "has_mask",
        "last_mask_s",
        "limit",
        "mask_cost_s",
        "mask_seconds",
        "matcher",
        "memory_bytes",
        "num_deferred",
        "proposal_rows",
        "row",
        "template",
        "vocab_size",
    )

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, template: _Template | None = None
    ) -> None:
        self.matcher = matcher
        self.template = template  # the cache's entry, which shares its lexer
        self.vocab_size = vocab_size  # the mask's width, in tokens
        # The next-token mask: bit b of word w allows token 32 w + b (llguidance's layout).
        self.row = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
        self.has_mask = False  # `row` is the mask of the current position
        # Speculative decoding: the masks of the positions after each proposed token the
        # step verifies (`fill_proposals`), one row each.
        self.proposal_rows = np.empty((0, self.row.shape[1]), dtype=np.int32)
        self.num_deferred = 0  # steps in a row this request sat out for the step's budget
        self.debt_s = 0.0  # mask time taken past its fair shares of the steps' budgets
        self.mask_cost_s = 0.0  # the last mask computed, kept while it waits: its expected cost
        self.error: str | None = None
        self.limit: GrammarLimit | None = None
        self.mask_seconds = 0.0  # over the request's life: MASK_TIME_BUDGET_S
        self.last_mask_s = 0.0  # the last mask computed (0: none, or past a budget)
        self.memory_bytes = 0  # RSS its masks added: MATCHER_MEMORY_BUDGET

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; True when the grammar is complete (the output is
        whole and only EOS could follow). A token the grammar refuses leaves `error` set:
        with `limit` `parser` when the mask allowed it (llguidance reached a limit while
        lexing it), without a limit when the mask did not (an engine bug); a grammar
        already failed accepts nothing."""
        matcher = self.matcher
        if self.error is not None:
            return False
        allowed = self.has_mask and self._allows(token_id)
        self.has_mask = False
        if not matcher.consume_token(token_id) or matcher.is_error():
            if allowed:
                self._exceed(GrammarLimit.PARSER, "a parser limit stopped a token its mask allowed")
            else:
                self.error = matcher.get_error() or "token refused"
            return False
        return bool(matcher.is_stopped())

    def _allows(self, token_id: int, row: np.ndarray | None = None) -> bool:
        mask = self.row[0] if row is None else row
        word = int(mask[token_id >> 5]) if 0 <= token_id < self.vocab_size else 0
        return bool((word >> (token_id & 31)) & 1)

    def fill_proposals(self, token_ids: list[int]) -> int:
        """The masks of the positions after each proposed token, into `proposal_rows`, as
        far as the grammar allows the tokens (the current mask, `row`, already computed);
        the matcher is rolled back to where it was. Returns how many of `token_ids` it
        allows in a row: those past them could never be accepted. Their time is charged to
        the request's mask budget (`mask_seconds`)."""
        self.proposal_rows = np.full((len(token_ids), self.row.shape[1]), -1, dtype=np.int32)
        if self.error is not None or not self.has_mask:
            return 0
        matcher = self.matcher
        started = time.perf_counter()
        mask = self.row[0]
        count = 0
        for token_id in token_ids:
            if not self._allows(token_id, mask) or not matcher.consume_token(token_id):
                break
            count += 1
            if matcher.is_error() or matcher.is_stopped():
                break  # complete: the request ends at this token, what follows is unused
            llguidance.numpy.fill_next_token_bitmask(matcher, self.proposal_rows, count - 1)
            mask = self.proposal_rows[count - 1]
        if count:
            matcher.rollback(count)
        self.mask_seconds += time.perf_counter() - started
        return count

    @property
    def is_free(self) -> bool:
        """Whether this step's mask costs nothing: already computed, or failed (all ones)."""
        return self.has_mask or self.error is not None

    def fill(self) -> None:
        """Compute the next-token mask into `row` and charge its cost to the request's
        budgets. Past one, the row allows every token (the request fails anyway)."""
        self.last_mask_s = 0.0
        template = self.template
        if self.error is None and template is not None and template.limit is not None:
            self._exceed(template.limit, "another request with this schema went past it")
        if self.error is not None:
            self.row.fill(-1)
            return
        rss = _rss_bytes()
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.row, 0)
        self.last_mask_s = self.mask_cost_s = time.perf_counter() - started
        self.mask_seconds += self.last_mask_s
        self.has_mask = True
        grown = max(0, _rss_bytes() - rss)
        self.memory_bytes += grown
        if template is not None:
            template.memory_bytes += grown
        if self.matcher.is_error():
            self._exceed(GrammarLimit.PARSER, "a parser limit stopped its mask")
        elif self.mask_seconds > MASK_TIME_BUDGET_S:
            self._exceed(GrammarLimit.MASK_TIME, f"its masks took more than {MASK_TIME_BUDGET_S} s")
        elif self.memory_bytes > MATCHER_MEMORY_BUDGET:
            self._exceed(
                GrammarLimit.MATCHER_MEMORY,
                f"its masks took more than {MATCHER_MEMORY_BUDGET >> 20} MiB",
            )
        if self.error is not None:
            self.row.fill(-1)

    def _exceed(self, limit: GrammarLimit, why: str) -> None:
        self.limit = limit
        if self.template is not None:
            self.template.limit = limit
        self.error = f"the request's grammar is too costly: {why} ({limit} budget)"


def fill_within(grammars: Sequence[RequestGrammar], budget_s: float | None = None) -> float:
    """Compute this step's masks of `grammars` within `budget_s` (default
    STEP_MASK_BUDGET_S), charging time, not turns. Each grammar that needs a mask has a fair
    share of the budget (budget / their number) and carries a debt in seconds: computing it
    adds its mask's time less the share, sitting the step out takes the share off. They are
    taken least debt first (then longest waiting, `num_deferred`); one is computed while the
    step has spent less than the budget and its debt is not positive, or its last mask fits
    in what is left, and the first one always. So a costly grammar among cheap ones gets a
    mask about once per (its cost / share) steps while the cheap ones get one every step,
    and one alone every step. Debt is kept at -share or more (nothing banks credit), and
    what all owe at once is forgiven (a step over budget that none could avoid: one
    alone, or all costly), so none waits for costs it ran up alone. A grammar that costs
    nothing this step (`is_free`) is always kept. Returns the seconds spent. One after the
    other: llguidance's parallel executor took 8x longer here (0.8 ms for 8 masks), its
    threads competing with torch's on two cores, than computing them in turn (~13 µs each)."""
    budget_s = STEP_MASK_BUDGET_S if budget_s is None else budget_s
    pending = []
    for grammar in grammars:
        if grammar.is_free:
            grammar.last_mask_s = 0.0
            grammar.num_deferred = 0
        else:
            pending.append(grammar)
    if not pending:
        return 0.0
    share = budget_s / len(pending)
    spent = 0.0
    for turn, grammar in enumerate(sorted(pending, key=lambda g: (g.debt_s, -g.num_deferred))):
        fits = spent < budget_s and (grammar.debt_s <= 0 or spent + grammar.mask_cost_s <= budget_s)
        if turn == 0 or fits:
            grammar.fill()
            spent += grammar.last_mask_s
            grammar.num_deferred = 0
            grammar.debt_s += grammar.last_mask_s - share
        else:
            grammar.last_mask_s = 0.0
            grammar.num_deferred += 1
            grammar.debt_s -= share
    # All in debt: a step over budget that none could avoid (one alone, or all costly).
    least = min(grammar.debt_s for grammar in pending)
    for grammar in pending:
        grammar.debt_s = max(grammar.debt_s - max(least, 0.0), -share)
    return spent


def fill_bitmasks(grammars: Sequence[RequestGrammar], offsets: Sequence[int] = ()) -> bytes:
    """The next-token masks of `grammars` for the sampling rank, one row of
    ceil(vocab_size / 32) int32 words each; a mask not computed yet (`fill_within`) is
    computed now. `offsets` (default all 0): the row's position after that many proposed
    tokens (`RequestGrammar.fill_proposals`)."""
    for grammar in grammars:
        if not grammar.is_free:
            grammar.fill()
    rows = [
        grammar.row if not offset else grammar.proposal_rows[offset - 1 : offset]
        for grammar, offset in zip(grammars, offsets or [0] * len(grammars), strict=True)
    ]
    return np.concatenate(rows).tobytes()


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
        self.limit: GrammarLimit | None = None  # a budget one of its requests went past
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
            raise RequestError(refused, code=LIMIT_EXCEEDED, param=param_of(spec))
        template = self._cache.get(spec)
        if template is None:
            check(spec)  # the core refuses on its own what the front end would
            started = time.perf_counter()
            matcher = llguidance.LLMatcher(
                self._llg_tokenizer(), grammar_of(spec), log_level=0, limits=LIMITS
            )
            if matcher.is_error():
                error = str(matcher.get_error())
                raise RequestError(
                    f"invalid grammar: {error[:MAX_ERROR_CHARS]}",
                    code=LIMIT_EXCEEDED if is_limit_error(error) else ErrorCode.INVALID_VALUE,
                    param=param_of(spec),
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
                    f"the grammar is too costly ({template.limit} budget "
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
