"""Logprobs through the engine equal transformers' log_softmax of the same logits (float32,
within 1e-3), for the sampled token and the top-k, greedy and sampled, at TP=1 and TP=2;
they are taken before penalties and temperature, as vLLM reports them."""

from __future__ import annotations

import pytest
import torch

from otel_engine import LLM, SamplingParams
from otel_engine.outputs import TokenLogprobs

pytestmark = pytest.mark.slow  # starts engines

MAX_TOKENS = 6
TOP = 5


def hf_logprobs(model_dir: str, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at each generated position [T, vocab]."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(generated)], dim=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_equal_transformers_log_softmax(
    tiny_model_dir: str, tiny_prompts: list[list[int]], tp: int
) -> None:
    prompts = tiny_prompts[3:6]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    # Sampled, hot and penalized: the reported values are still the raw model's.
    sampled = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=1.5,
        seed=7,
        ignore_eos=True,
        logprobs=0,
        frequency_penalty=1.0,
    )
    with LLM(tiny_model_dir, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=256) as llm:
        outputs = llm.generate(prompts, greedy) + llm.generate(prompts, sampled)

    num_top = [TOP] * len(prompts) + [0] * len(prompts)
    for output, prompt, k in zip(outputs, prompts * 2, num_top, strict=True):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        assert completion.logprobs is not None
        assert len(tokens) == len(completion.logprobs)
        reference = hf_logprobs(tiny_model_dir, prompt, tokens)
        for position, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            expected = reference[position]
            assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-3)
            assert k == len(entry.top_token_ids)
            for top_id, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
                assert value == pytest.approx(float(expected[top_id]), abs=1e-3)
            if entry.top_logprobs:
                best = expected.topk(TOP).values.tolist()
                assert entry.top_logprobs == pytest.approx(best, abs=1e-3)


def test_no_logprobs_unless_asked(tiny_model_dir: str, tiny_prompts: list[list[int]]) -> None:
    with LLM(tiny_model_dir, dtype="float32") as llm:
        [output] = llm.generate(tiny_prompts[:1], SamplingParams(max_tokens=2))

    assert output.outputs[0].logprobs is None


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at every prompt position [len - 1, vocab]
    (position p scores prompt token p + 1)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_equal_transformers_in_chunks_and_skip_the_cache(
    tiny_model_dir: str, tiny_prompts: list[list[int]], tp: int
) -> None:
    """A 120-token prompt prefilled in 24-token chunks (and computed once before, so the
    prefix cache holds it): one entry per prompt token from the second on, each equal to
    transformers' log_softmax within 1e-3, with its top 3."""
    prompt = tiny_prompts[-1]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    with LLM(
        tiny_model_dir,
        dtype="float32",
        tensor_parallel_size=tp,
        max_num_batched_tokens=24,
        num_kv_blocks=256,
    ) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt is now cached
        [output] = llm.generate([prompt], params)

    reference = hf_prompt_logprobs(tiny_model_dir, prompt)
    entries = output.prompt_logprobs
    assert entries is not None
    assert len(prompt) - 1 == len(entries)
    for position, entry in enumerate(entries):
        expected = reference[position]
        assert entry.logprob == pytest.approx(float(expected[prompt[position + 1]]), abs=1e-3)
        assert entry.top_logprobs == pytest.approx(expected.topk(3).values.tolist(), abs=1e-3)


def test_prompt_logprobs_survive_preemption(
    tiny_model_dir: str, tiny_prompts: list[list[int]]
) -> None:
    """On a cache too small for the batch, requests are preempted and recomputed from
    position 0: each still reports every prompt position once, in order, with transformers'
    values (a recomputed chunk adds nothing it already had)."""
    from otel_engine.engine.core_client import InprocClient

    prompts = tiny_prompts[-3:]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    small = {"block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 24}
    with LLM(tiny_model_dir, dtype="float32", **small) as llm:
        outputs = llm.generate(prompts, params)
        client = llm._frontend.client
        assert isinstance(client, InprocClient)
        assert client.core.scheduler.num_preemptions > 0

    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_prompt_logprobs(tiny_model_dir, prompt)
        entries = output.prompt_logprobs
        assert entries is not None
        assert len(prompt) - 1 == len(entries)
        expected = [float(reference[p][prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-3)


def test_chat_bytes_are_each_tokens_own_bytes(tiny_model_dir: str) -> None:
    """Characters split across tokens (é, 🌍, 世界 in a byte-level BPE): each token's `bytes`
    are its own, so that they join into the text's UTF-8, where each token decoded alone
    shows U+FFFD; special tokens are their text."""
    from transformers import AutoTokenizer

    from otel_engine.entrypoints.openai.logprobs import LogprobsFormatter

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "héllo 🌍 naïve 世界<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = [TokenLogprobs(-1.0, [t], [-1.0]) for t in ids]

    content = LogprobsFormatter(tokenizer).chat(ids, entries)["content"]

    assert any("\ufffd" in entry["token"] for entry in content)  # the case this is about
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    for entry in content:
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
