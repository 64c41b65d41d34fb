"""The Llama model on the paged KV cache: logits equal transformers' for full prefills,
chunked prefills, mixed decode/prefill batches and scattered block tables; tensor-parallel
sizes that do not divide the heads are refused with the numbers."""

from __future__ import annotations

import pytest
import torch

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import prepare_model_input
from otel_engine.executor.model_runner import ModelRunner, _kv_caches
from otel_engine.ipc.messages import ModelInput
from otel_engine.model.arch import load_model_arch
from otel_engine.model.limits import check_tensor_parallel
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4


@pytest.fixture(scope="module")
def runner(tiny_model_dir: str) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=tiny_model_dir, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, multiprocess=False
    )
    return ModelRunner(config, tiny_model_dir)


@pytest.fixture(scope="module")
def bf16_runner(tiny_model_dir: str) -> ModelRunner:
    """The runner in bfloat16: its compiled kernels run on every x86 level (float32 runs on
    torch ops below AVX-512)."""
    config = EngineConfig.from_kwargs(
        model=tiny_model_dir,
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        multiprocess=False,
    )
    return ModelRunner(config, tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids`, [T, vocab]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def forward_logits(runner: ModelRunner, step: ModelInput) -> torch.Tensor:
    """The runner's forward on `step`, returning the logits of every token [T, vocab]."""
    input_ids, meta = runner.forward_inputs(step)
    with torch.inference_mode():
        hidden = runner.model.forward(input_ids, runner.kv_caches, meta)
        return runner.model.compute_logits(hidden)


def make_request(request_id: str, token_ids: list[int], block_ids: list[int]) -> Request:
    request = Request(request_id, list(token_ids), SamplingParams(temperature=0.0))
    request.block_ids = list(block_ids)
    return request


def run_chunks(
    runner: ModelRunner, step_id: int, chunks: list[ScheduledChunk]
) -> list[torch.Tensor]:
    """Run one step; return each chunk's logits rows, in the given chunk order."""
    step = prepare_model_input(step_id, chunks, BLOCK_SIZE)
    logits = forward_logits(runner, step)
    rows, start = [], 0
    for chunk in chunks:
        rows.append(logits[start : start + chunk.num_tokens])
        start += chunk.num_tokens
    return rows


def test_tensor_parallel_size_must_divide_heads(tiny_model_dir: str) -> None:
    """TP=3 on 4 query / 2 key-value heads is refused with the flag name and head counts."""
    arch = load_model_arch(tiny_model_dir)

    with pytest.raises(ValueError, match="tensor-parallel-size 3") as info:
        check_tensor_parallel(arch, 3)

    assert "4 attention heads" in str(info.value)
    assert "2 key/value heads" in str(info.value)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_dividing_tensor_parallel_sizes_pass(tiny_model_dir: str, tp_size: int) -> None:
    """Sizes that divide every split dimension are accepted."""
    check_tensor_parallel(load_model_arch(tiny_model_dir), tp_size)


def test_full_prefill_matches_transformers(
    runner: ModelRunner, hf_model: torch.nn.Module, tiny_prompts: list[list[int]]
) -> None:
    """One prefill of a 55-token prompt gives transformers' logits at every position."""
    prompt = tiny_prompts[6]
    request = make_request("full", prompt, list(range(14)))

    (logits,) = run_chunks(runner, 1, [ScheduledChunk(request, 0, len(prompt))])

    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_transformers(
    runner: ModelRunner, hf_model: torch.nn.Module, tiny_prompts: list[list[int]]
) -> None:
    """A 34-token prompt in chunks of 13, 13 and 8, then two decodes, matches one full pass."""
    tokens = tiny_prompts[5] + [5, 9]
    request = make_request("chunked", tokens, [20, 21, 22, 23, 24, 25, 26, 27, 28])
    expected = hf_logits(hf_model, tokens)

    got = []
    for step_id, (start, size) in enumerate([(0, 13), (13, 13), (26, 8), (34, 1), (35, 1)]):
        got += run_chunks(runner, step_id, [ScheduledChunk(request, start, size)])

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_mixed_batch_equals_sequences_alone(
    runner: ModelRunner, hf_model: torch.nn.Module, tiny_prompts: list[list[int]]
) -> None:
    """A step holding a decode, a first prefill chunk and a later prefill chunk gives each
    sequence transformers' logits."""
    decoding = make_request("decode", tiny_prompts[2] + [11], [40, 41, 42])
    fresh = make_request("fresh", tiny_prompts[3], [43, 44, 45, 46])
    later = make_request("later", tiny_prompts[4], [47, 48, 49, 50, 51, 52])
    run_chunks(runner, 1, [ScheduledChunk(decoding, 0, 8)])
    run_chunks(runner, 2, [ScheduledChunk(later, 0, 10)])

    rows = run_chunks(
        runner,
        3,
        [
            ScheduledChunk(decoding, 8, 1),
            ScheduledChunk(fresh, 0, 13),
            ScheduledChunk(later, 10, 11),
        ],
    )

    torch.testing.assert_close(
        rows[0], hf_logits(hf_model, decoding.prompt_token_ids)[8:], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        rows[1], hf_logits(hf_model, fresh.prompt_token_ids), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        rows[2], hf_logits(hf_model, later.prompt_token_ids)[10:], atol=ATOL, rtol=0
    )


def test_batched_decodes_of_different_lengths(
    runner: ModelRunner, hf_model: torch.nn.Module, tiny_prompts: list[list[int]]
) -> None:
    """Decodes of a 3-token and a 21-token sequence in one step each read only their blocks."""
    short = make_request("short", tiny_prompts[0] + [7], [60])
    long = make_request("long", tiny_prompts[4] + [7], [61, 62, 63, 64, 65, 66])
    run_chunks(runner, 1, [ScheduledChunk(short, 0, 3), ScheduledChunk(long, 0, 21)])

    rows = run_chunks(runner, 2, [ScheduledChunk(short, 3, 1), ScheduledChunk(long, 21, 1)])

    torch.testing.assert_close(
        rows[0], hf_logits(hf_model, short.prompt_token_ids)[3:], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        rows[1], hf_logits(hf_model, long.prompt_token_ids)[21:], atol=ATOL, rtol=0
    )


def test_scattered_block_table_gives_same_logits(
    runner: ModelRunner, hf_model: torch.nn.Module, tiny_prompts: list[list[int]]
) -> None:
    """Blocks out of order and far apart hold the sequence as well as contiguous ones."""
    tokens = tiny_prompts[4] + [3]
    request = make_request("scattered", tokens, [90, 2, 77, 31, 8, 55])

    (first,) = run_chunks(runner, 1, [ScheduledChunk(request, 0, 9)])
    (second,) = run_chunks(runner, 2, [ScheduledChunk(request, 9, 12)])
    (third,) = run_chunks(runner, 3, [ScheduledChunk(request, 21, 1)])

    got = torch.cat([first, second, third])
    torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_kv_caches_share_one_zeroed_mapping_without_overlap() -> None:
    """On the CPU every layer's key and value cache is a view of one mapping (on 2 MiB pages
    where Linux grants them): each zeroed, contiguous, of the shape and dtype asked, back to
    back, and a write to one leaves every other as it was."""
    shape = (3, 7, 16, 64)
    caches = _kv_caches(shape, torch.bfloat16, torch.device("cpu"), num_layers=3)
    tensors = [t for pair in caches for t in pair]
    assert len(tensors) == 6
    nbytes = tensors[0].numel() * tensors[0].element_size()
    for index, tensor in enumerate(tensors):
        assert tensor.shape == shape
        assert tensor.dtype == torch.bfloat16
        assert tensor.is_contiguous()
        assert tensor.data_ptr() == tensors[0].data_ptr() + index * nbytes
        assert not tensor.any()
    tensors[2].fill_(1.0)
    assert [bool(t.any()) for t in tensors] == [False, False, True, False, False, False]


def test_greedy_steps_take_the_tokens_the_sampler_would(
    bf16_runner: ModelRunner, tiny_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy step that asks for no logprobs takes each row's argmax of the LM head's
    output (`greedy_tokens`); asking for logprobs takes the sampler's path: the same tokens,
    row by row."""
    runner = bf16_runner
    calls: list[int] = []
    greedy_tokens = runner.model.greedy_tokens

    def counted(hidden: torch.Tensor) -> list[int] | None:
        calls.append(hidden.shape[0])
        return greedy_tokens(hidden)

    monkeypatch.setattr(runner.model, "greedy_tokens", counted)

    def sampled(logprobs: int | None) -> list[int]:
        chunks, free = [], iter(range(NUM_BLOCKS))
        for index, prompt in enumerate(tiny_prompts[:4]):
            params = SamplingParams(temperature=0.0, logprobs=logprobs)
            request = Request(f"g{index}", list(prompt), params)
            request.block_ids = [next(free) for _ in range(-(-len(prompt) // BLOCK_SIZE))]
            chunks.append(ScheduledChunk(request, 0, len(prompt)))
        return runner.execute(prepare_model_input(1, chunks, BLOCK_SIZE)).sampled_token_ids

    assert runner.model.ops.argmax is not None
    fast = sampled(None)
    assert calls == [4]
    assert sampled(0) == fast
    assert calls == [4]  # logprobs asked: the sampler's path


def test_kv_cache_that_cannot_be_mapped_names_the_flags() -> None:
    """A KV cache beyond what the machine can map (here 2^50 bytes) is a MemoryError that says
    how large it was and which flags make it smaller, before any model runs."""
    with pytest.raises(MemoryError, match=r"--kv-cache-memory-gib or --num-kv-blocks"):
        _kv_caches((1, 1 << 40, 16, 64), torch.bfloat16, torch.device("cpu"), num_layers=1)
