"""Speculative decoding is exact: with it on, every request gets the tokens it gets with it
off (greedy, seeded sampling with every logits feature, stop tokens, min_tokens, logprobs,
structured output), whatever the proposals and however many are accepted.

Three sources of proposals, on the tiny random model in float32:
- an oracle that proposes each request's true continuation with every third token wrong
  (so steps accept some proposals and reject others at every position), injected into the
  engine core in place of the n-gram proposer: the verification itself under test;
- the draft model method with the model as its own draft (nearly every proposal accepted);
- the draft model method with another random model as the draft (nearly none accepted).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from otel_engine import LLM, SamplingParams
from otel_engine.config import SpeculativeConfig, SpeculativeMethod
from otel_engine.engine.structured_output import from_response_format
from otel_engine.outputs import RequestOutput
from otel_engine.sched.scheduler import ScheduledChunk
from otel_engine.spec.speculator import Speculator
from tests.helpers.tiny_model import write_tiny_llama

pytestmark = pytest.mark.slow  # engines

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
WRONG_EVERY = 3


def _features(eos_token_id: int) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(
            max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True
        ),
        "penalties": SamplingParams(
            max_tokens=24,
            temperature=0.7,
            seed=3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            repetition_penalty=1.2,
            min_p=0.05,
            ignore_eos=True,
        ),
        # EOS pushed up but banned for 6 tokens: the request ends soon after, mid-step.
        "min_tokens": SamplingParams(
            max_tokens=24, temperature=0.0, min_tokens=6, logit_bias=((eos_token_id, 12.0),)
        ),
        "logprobs": SamplingParams(
            max_tokens=16, temperature=0.8, seed=5, logprobs=3, ignore_eos=True
        ),
        "structured": SamplingParams(
            max_tokens=40,
            temperature=0.0,
            structured_output=from_response_format(
                {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
            ),
        ),
    }


class Oracle(Speculator):
    """Proposes each request's continuation from the reference run, every WRONG_EVERY-th
    output position's proposal off by one token."""

    method = SpeculativeMethod.NGRAM

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        super().__init__(SpeculativeConfig(num_speculative_tokens=4))
        self.references = references
        self.vocab_size = vocab_size
        self.num_proposed = 0

    def propose(self, chunks: Sequence[ScheduledChunk], step_id: int = 0) -> None:
        for chunk in chunks:
            if not chunk.num_spec_slots:
                continue
            request = chunk.request
            done = request.num_output_tokens
            truth = self.references[tuple(request.prompt_token_ids)][done:]
            drafts = [
                token if (done + offset) % WRONG_EVERY else (token + 1) % self.vocab_size
                for offset, token in enumerate(truth[: chunk.num_spec_slots])
            ]
            chunk.draft_token_ids = drafts
            chunk.num_tokens += len(drafts)
            self.num_proposed += len(drafts)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate([list(p) for p in prompts], params)


def _same(expected: list[RequestOutput], got: list[RequestOutput], logprobs: bool) -> None:
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert list(b.token_ids) == list(a.token_ids)
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
        assert b.text == a.text
        if logprobs:
            assert a.logprobs is not None
            assert b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.top_token_ids == y.top_token_ids
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


@pytest.fixture(scope="module")
def references(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> Iterator[dict[str, list[RequestOutput]]]:
    """Every feature's outputs with speculation off."""
    with LLM(tiny_model_dir, dtype="float32") as llm:
        eos = llm.tokenizer.eos_token_id
        yield {name: _run(llm, tiny_prompts[:4], p) for name, p in _features(eos).items()}


@pytest.mark.parametrize(
    "feature", ["greedy", "seeded", "penalties", "min_tokens", "logprobs", "structured"]
)
def test_verifying_oracle_proposals_changes_nothing(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    references: dict[str, list[RequestOutput]],
    feature: str,
) -> None:
    expected = references[feature]
    prompts = tiny_prompts[:4]
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, expected, strict=True)}
    with LLM(tiny_model_dir, dtype="float32", speculative_method="ngram") as llm:
        core = llm._frontend.client.core  # type: ignore[attr-defined]
        oracle = Oracle(truth, core.arch.vocab_size)
        core.speculator = core.scheduler.speculation = oracle
        params = _features(llm.tokenizer.eos_token_id)[feature]

        got = _run(llm, tiny_prompts[:4], params)

    _same(expected, got, logprobs=feature == "logprobs")
    assert oracle.num_proposed > 0
    drafted = sum(o.metrics.get("num_draft_tokens", 0) for o in got)
    accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in got)
    assert 0 < accepted < drafted  # some accepted, some refused


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another random model with the tiny model's tokenizer: a draft that is nearly always
    wrong."""
    return write_tiny_llama(tmp_path_factory.mktemp("other-tiny"), seed=7)


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_a_draft_model_changes_nothing(
    tiny_model_dir: str,
    other_model_dir: str,
    tiny_prompts: list[list[int]],
    references: dict[str, list[RequestOutput]],
    draft: str,
) -> None:
    draft_dir = tiny_model_dir if draft == "itself" else other_model_dir
    with LLM(
        tiny_model_dir,
        dtype="float32",
        speculative_method="draft",
        speculative_model=draft_dir,
        num_speculative_tokens=3,
    ) as llm:
        features = _features(llm.tokenizer.eos_token_id)
        runs = {name: _run(llm, tiny_prompts[:4], p) for name, p in features.items()}

    drafted = accepted = 0
    for name, got in runs.items():
        _same(references[name], got, logprobs=name == "logprobs")
        drafted += sum(o.metrics.get("num_draft_tokens", 0) for o in got)
        accepted += sum(o.metrics.get("num_accepted_tokens", 0) for o in got)
    assert drafted > 0
    if draft == "itself":
        assert accepted / drafted > 0.9
    else:
        assert accepted / drafted < 0.5


def test_a_draft_prefill_counts_in_what_its_step_delivered(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """A request's first proposals need the draft to prefill its prompt in that step: the
    prefill's seconds are in the step's draft time, which the step's delivery (tokens per
    second over a plain step's) is measured with."""
    with LLM(
        tiny_model_dir,
        dtype="float32",
        speculative_method="draft",
        speculative_model=tiny_model_dir,
        num_speculative_tokens=3,
    ) as llm:
        speculator = llm._frontend.client.core.speculator  # type: ignore[union-attr]
        seen: list[tuple[float, float | None]] = []
        observe_step = speculator.observe_step

        def recording(num_sequences: int, seconds: float) -> None:
            if speculator.step_draft_seconds:
                prefill = speculator.draft_cost.prefill_token_seconds
                seen.append((speculator.step_draft_seconds, prefill))
            observe_step(num_sequences, seconds)

        speculator.observe_step = recording
        prompt = tiny_prompts[0]
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    assert seen
    draft_seconds, per_token = seen[0]  # the first verifying step: the prompt's prefill
    assert per_token is not None
    assert draft_seconds >= per_token * len(prompt)


def test_tensor_parallel_two_with_a_draft_model(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """At TP 2 the draft runs in the engine core, beside the two ranks of the target."""
    features = ("greedy", "seeded", "penalties")
    with LLM(tiny_model_dir, dtype="float32", tensor_parallel_size=2) as llm:
        params = _features(llm.tokenizer.eos_token_id)
        expected = {name: _run(llm, tiny_prompts[:3], params[name]) for name in features}
    with LLM(
        tiny_model_dir,
        dtype="float32",
        tensor_parallel_size=2,
        speculative_method="draft",
        speculative_model=tiny_model_dir,
    ) as llm:
        got = {name: _run(llm, tiny_prompts[:3], params[name]) for name in features}

    for name in features:
        _same(expected[name], got[name], logprobs=False)
        assert sum(o.metrics.get("num_accepted_tokens", 0) for o in got[name]) > 0


def test_preemption_and_the_prefix_cache_with_speculation(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """A cache too small for the batch preempts speculating requests (their K/V, and their
    draft model's, recomputed); the same prompts again find their prefixes cached."""
    prompts = [p for p in tiny_prompts if len(p) >= 20][:4]
    params = SamplingParams(max_tokens=48, temperature=0.6, seed=9, ignore_eos=True)
    options = {"dtype": "float32", "num_kv_blocks": 14, "block_size": 16}
    with LLM(tiny_model_dir, **options) as llm:
        expected = _run(llm, prompts, params)
    with LLM(
        tiny_model_dir,
        speculative_method="draft",
        speculative_model=tiny_model_dir,
        **options,
    ) as llm:
        first = _run(llm, prompts, params)
        # One at a time, the last to finish first: its blocks are the last evicted.
        again = [_run(llm, [prompt], params)[0] for prompt in prompts[::-1]][::-1]

    assert sum(o.metrics.get("num_preemptions", 0) for o in first) > 0
    assert sum(o.metrics.get("num_cached_tokens", 0) for o in again) > 0
    _same(expected, first, logprobs=False)
    _same(expected, again, logprobs=False)


def test_ngram_proposals_on_a_repeating_text_are_exact(tiny_model_dir: str, tmp_path: Path) -> None:
    """Prompt lookup itself, greedy and seeded: the tiny model's output has few repeats, so
    this holds exactness where proposals come and go; the bench measures its acceptance on
    real text with the real model."""
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 8 + [40], list(range(100, 160))]
    for params in (
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=64, temperature=1.0, seed=1, ignore_eos=True),
    ):
        with LLM(tiny_model_dir, dtype="float32") as llm:
            expected = _run(llm, prompts, params)
        with LLM(tiny_model_dir, dtype="float32", speculative_method="ngram", ngram_min=1) as llm:
            got = _run(llm, prompts, params)
        _same(expected, got, logprobs=False)
        assert sum(o.metrics.get("num_draft_tokens", 0) for o in got) > 0


def test_a_draft_model_with_another_vocabulary_is_refused_at_start(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from otel_engine import EngineStartupError

    other = write_tiny_llama(tmp_path / "other-vocab", vocab=512)

    with pytest.raises(EngineStartupError, match="does not share the model's tokenizer"):
        LLM(tiny_model_dir, speculative_method="draft", speculative_model=other)


def test_a_draft_model_that_is_not_there_fails_the_start_naming_it(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from otel_engine import EngineStartupError

    missing = tmp_path / "no-such-draft.gguf"

    with pytest.raises(EngineStartupError, match=r"no-such-draft\.gguf"):
        LLM(tiny_model_dir, speculative_method="draft", speculative_model=str(missing))
