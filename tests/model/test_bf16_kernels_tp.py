"""The bfloat16 kernels that run at head sizes 64 and 128 (decode attention by vdpbf16ps, the
compiled prefill attention) inside whole engines at TP=1 and TP=2 (head size 128 at TP=1),
against the same engine on torch ops: prompt log-probs (prefill, chunked by a small token
budget, across block boundaries) and greedy continuations (decode steps mixed with prefill
chunks, one sequence running to max_model_len) agree within bfloat16 rounding.

This random model's logits reach about 40, where bfloat16 values are 0.25 apart, and both
paths round at every op in different places: measured, prompt log-probs differ by up to 5% of
their size (1.2 nats at -32) and a chosen token's by up to 0.41 nats, the same with the two
attention kernels switched off (the compiled kernels before them against torch ops: 4.4%,
0.40 nats). The bounds below are those, with a little room."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_engine import LLM, SamplingParams
from otel_engine.model.fast_paths import BF16_ISA
from otel_engine.outputs import CompletionOutput, RequestOutput
from tests.helpers.isa import require_isa
from tests.helpers.tiny_model import write_tiny_llama

pytestmark = pytest.mark.slow  # starts engines with worker processes

MAX_MODEL_LEN = 64
# prompts of 5, 17 (past a 16-token block) and 40 tokens (chunked by the 32-token budget);
# the last, 56 tokens + 8 generated, ends at max_model_len
PROMPT_LENS = [5, 17, 40, 56]
NUM_TOKENS = 8
PROMPT_TOLERANCE = 0.07  # of the log-prob's size, plus 0.05
TOKEN_TOLERANCE = 0.5  # a chosen token's log-prob, nats
# Heads of 128 drift further apart: their scores are larger, and torch's path rounds them to
# bfloat16 where the kernels keep float32. Measured on the model below: prompt log-probs up to
# 10% apart (1.99 nats at -19.2), a chosen token's up to 0.57 nats on other seeds; the same
# (1.86 nats, 0.54) with decode attention in the generic loop and prefill in torch's fused
# attention, before head size 128 had kernels.
HEAD128_PROMPT_TOLERANCE = 0.12
HEAD128_TOKEN_TOLERANCE = 0.7


@pytest.fixture(scope="module")
def head64_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with heads of 64 (4 heads, 2 KV heads), where the kernels apply."""
    path = Path(tmp_path_factory.mktemp("tiny-llama-head64"))
    return write_tiny_llama(path, hidden=256, heads=4, kv_heads=2, intermediate=256, seed=3)


def _generate(model_dir: str, kernels: str, tp: int) -> list[RequestOutput]:
    prompts = [[(7 * n + 3 * i) % 700 + 10 for i in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=1
    )
    with LLM(
        model_dir,
        dtype="bfloat16",
        kernels=kernels,
        tensor_parallel_size=tp,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        num_kv_blocks=64,
    ) as llm:
        return llm.generate(prompts, params)


def _assert_continuations_agree(
    fast: CompletionOutput, reference: CompletionOutput, tolerance: float = TOKEN_TOLERANCE
) -> None:
    """Token by token: the same greedy token with about the same log-prob; a different token
    only where it was among the reference's top five (then the continuations part ways: on
    this model a bfloat16 logit is off by up to 4% of 40 on either path, so a near-tie is
    anything within about 1.6)."""
    assert fast.logprobs is not None
    assert reference.logprobs is not None
    for token, other, mine, theirs in zip(
        fast.token_ids, reference.token_ids, fast.logprobs, reference.logprobs, strict=True
    ):
        if token != other:
            top = dict(zip(theirs.top_token_ids, theirs.top_logprobs, strict=True))
            assert token in top, (token, top)
            return
        assert abs(mine.logprob - theirs.logprob) <= tolerance


@pytest.fixture(scope="module")
def head128_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Heads of 128 in a group of 4 (4 heads, 1 KV head), as Qwen2.5-3B's and Llama-3.1-8B's."""
    path = Path(tmp_path_factory.mktemp("tiny-llama-head128"))
    return write_tiny_llama(
        path, hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=256, seed=3
    )


@pytest.mark.parametrize(("head_dim", "tp"), [(64, 1), (64, 2), (128, 1)])
def test_bfloat16_kernels_agree_with_torch_ops(
    request: pytest.FixtureRequest, head_dim: int, tp: int
) -> None:
    require_isa(BF16_ISA)  # elsewhere both engines run torch ops
    model_dir = request.getfixturevalue(f"head{head_dim}_model_dir")
    fast, reference = (_generate(model_dir, k, tp) for k in ("auto", "torch"))
    prompt, token = PROMPT_TOLERANCE, TOKEN_TOLERANCE
    if head_dim == 128:
        prompt, token = HEAD128_PROMPT_TOLERANCE, HEAD128_TOKEN_TOLERANCE
    for mine, theirs in zip(fast, reference, strict=True):
        assert mine.prompt_logprobs is not None
        assert theirs.prompt_logprobs is not None
        for a, b in zip(mine.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 0.05 + prompt * abs(b.logprob)
        _assert_continuations_agree(mine.outputs[0], theirs.outputs[0], token)
    assert len(fast[-1].outputs[0].token_ids) == NUM_TOKENS  # the last reached max_model_len
    assert len(fast[-1].prompt_token_ids) + NUM_TOKENS == MAX_MODEL_LEN
