"""The model runner: loads one rank's shard, owns its KV cache, runs a step's forward.

Used inside the engine core at TP=1 and inside each worker process at TP>1; the same
`ModelInput` drives both. Rank 0 measures the machine's memory read bandwidth before it
loads (`model/bandwidth.py`, on the CPU) and says what each step read (`model/step_reads.py`).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from otel_engine.config import Device, Dtype, EngineConfig
from otel_engine.ipc.messages import ModelInput, ModelOutput, PromptLogprobsChunk
from otel_engine.memory import huge_page_region, return_freed_memory
from otel_engine.model.arch import load_model_arch
from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.bandwidth import MemoryBandwidth, peak_read_bandwidth
from otel_engine.model.cpu import half_precision_blocker
from otel_engine.model.limits import (
    EngineLimits,
    choose_dtype,
    choose_kv_cache_dtype,
    resolve_limits,
)
from otel_engine.model.registry import load_model
from otel_engine.model.sampler import Sampler, logprobs_of
from otel_engine.model.step_reads import StepReads
from otel_engine.outputs import TokenLogprobs

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256  # positions whose logits are computed at once for prompt logprobs
_DTYPES: dict[str, torch.dtype] = {
    Dtype.FLOAT32: torch.float32,
    Dtype.BFLOAT16: torch.bfloat16,
    Dtype.FLOAT16: torch.float16,
}


def _warn_if_emulated(name: str) -> None:
    """An explicit half-precision --dtype on a CPU without its arithmetic: a warning with
    what it costs here, measured now (a [16, 1024] x [1024, 1024] matmul in each dtype, about
    0.1 s where the arithmetic is emulated)."""
    blocker = half_precision_blocker(name) if name != "float32" else None
    if blocker is None:
        return
    x, w = torch.randn(16, 1024), torch.randn(1024, 1024)
    seconds = {d: _best_matmul_s(x.to(_DTYPES[d]), w.to(_DTYPES[d])) for d in ("float32", name)}
    logger.warning(
        "dtype.emulated",
        extra={
            "dtype": name,
            "reason": blocker,
            "matmul_slowdown_vs_float32": round(seconds[name] / seconds["float32"], 1),
            "hint": "--dtype auto (or float32) runs this model in float32 on this CPU",
        },
    )


def _best_matmul_s(x: torch.Tensor, w: torch.Tensor, repeats: int = 2) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(x, w)
        best = min(best, time.perf_counter() - start)
    return best


class ModelRunner:
    """One rank's model, KV cache and (on rank 0) sampler. `limits` are the engine's
    (resolved once, in the engine core); None resolves them here, for a runner outside an
    engine (tests, benchmarks)."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        limits: EngineLimits | None = None,
        *,
        rank: int = 0,
        is_draft: bool = False,
    ) -> None:
        """`is_draft`: speculative decoding's draft model, beside the target in the engine
        core (spec/draft.py): no bandwidth probe of its own, and its start log says so."""
        self.config = config
        self.rank = rank
        self.arch = load_model_arch(model_dir)
        self.limits = limits if limits is not None else resolve_limits(config, self.arch)
        self.device = torch.device(
            config.model.device if config.model.device == Device.CPU else f"cuda:{rank}"
        )
        dtype = choose_dtype(config, self.arch)
        self.dtype = _DTYPES[dtype.name]
        kv_dtype = choose_kv_cache_dtype(config, self.arch)
        self.kv_dtype = _DTYPES[kv_dtype.name]
        if dtype.reason == "--dtype" and self.device.type == "cpu" and rank == 0:
            _warn_if_emulated(dtype.name)
        self.block_size = config.cache.block_size
        # Before the model is in memory: the probe's buffer never adds to the peak.
        self.memory_bandwidth: MemoryBandwidth | None = (
            peak_read_bandwidth()
            if rank == 0 and self.device.type == "cpu" and not is_draft
            else None
        )
        self.model = load_model(
            model_dir,
            self.arch,
            dtype=self.dtype,
            device=self.device,
            tp_rank=rank,
            tp_size=config.parallel.tensor_parallel_size,
            max_positions=self.limits.max_model_len,
            kernels=config.model.kernels,
            int4=config.model.int4,
            quant_activations=config.model.quant_activations,
            block_size=self.block_size,
        )
        logger.info(
            "kernels.selected",
            extra={
                **self.model.fast_paths.summary(),
                "rank": rank,
                "role": "draft" if is_draft else "target",
                "dtype": dtype.name,
                "dtype_reason": dtype.reason,
                "kv_cache_dtype": kv_dtype.name,
                "kv_cache_dtype_reason": kv_dtype.reason,
            },
        )
        return_freed_memory()  # the staged checkpoint, and bfloat16 copies the 4-bit replaced
        shape = (
            self.model.num_kv_heads,
            self.limits.num_kv_blocks,
            self.block_size,
            self.model.head_dim,
        )
        self.kv_caches = _kv_caches(shape, self.kv_dtype, self.device, self.arch.num_hidden_layers)
        self.sampler = Sampler(self.device, config.model.seed) if rank == 0 else None
        self.reads = StepReads.of(
            self.model, computes_logits=self.sampler is not None, kv_dtype=self.kv_dtype
        )

    def forward_inputs(self, step: ModelInput) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids as a tensor and its attention metadata (for every layer)."""
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        meta = self.model.ops.build_metadata(
            positions=step.positions,
            slot_mapping=step.slot_mapping,
            num_decodes=step.num_decodes,
            query_lens=step.query_lens,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            block_size=self.block_size,
        )
        return input_ids, meta

    @torch.inference_mode()
    def execute(self, step: ModelInput) -> ModelOutput:
        """Run the forward; rank 0 returns one sampled token per sampled sequence (and
        their logprobs where asked)."""
        device = self.device
        input_ids, meta = self.forward_inputs(step)
        hidden = self.model.forward(input_ids, self.kv_caches, meta)
        if self.sampler is None:
            return ModelOutput(step.step_id, [])
        logit_rows = len(step.sample_indices) + sum(c.num_targets for c in step.prompt_logprobs)
        read = self.reads.bytes_read(len(step.input_ids), step.seq_lens, logit_rows)
        prompt_logprobs = [self._prompt_logprobs(step, hidden, c) for c in step.prompt_logprobs]
        if not step.sample_indices:
            return ModelOutput(step.step_id, [], [], prompt_logprobs, read)
        ends = torch.tensor(step.query_lens, device=device).cumsum(0) - 1
        rows = ends[torch.tensor(step.sample_indices, dtype=torch.long, device=device)]
        if _greedy_only(step):
            greedy = self.model.greedy_tokens(hidden[rows])
            if greedy is not None:
                return ModelOutput(step.step_id, greedy, [], prompt_logprobs, read)
        logits = self.model.compute_logits(hidden[rows])
        tokens = self.sampler(
            logits,
            step.temperatures,
            step.top_ps,
            step.top_ks,
            step.seeds,
            step.output_positions,
            step.processing,
            step.grammar_rows,
            step.grammar_bitmask,
        )
        logprobs = logprobs_of(logits, tokens, step.num_logprobs) if step.num_logprobs else []
        return ModelOutput(step.step_id, tokens, logprobs, prompt_logprobs, read)

    def _prompt_logprobs(
        self, step: ModelInput, hidden: torch.Tensor, chunk: PromptLogprobsChunk
    ) -> list[TokenLogprobs]:
        """The logprobs of the prompt tokens that `chunk`'s positions predict, computed
        `PROMPT_LOGPROBS_ROWS` positions at a time (a chunk's logits over the vocabulary
        would be hundreds of MB at once)."""
        start = sum(step.query_lens[: chunk.seq_index])
        count = step.query_lens[chunk.seq_index]
        targets = step.input_ids[start + 1 : start + count][: chunk.num_targets]
        if len(targets) < chunk.num_targets:
            targets = [*targets, chunk.next_token_id]
        result: list[TokenLogprobs] = []
        for offset in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            part = targets[offset : offset + PROMPT_LOGPROBS_ROWS]
            rows = hidden[start + offset : start + offset + len(part)]
            logits = self.model.compute_logits(rows)
            result += logprobs_of(logits, part, [chunk.num_top] * len(part))  # type: ignore[arg-type]
        return result


def _greedy_only(step: ModelInput) -> bool:
    """Every sampled row takes its argmax of the raw logits: temperature 0, and no logit
    processing, grammar or logprobs."""
    if step.processing or step.grammar_rows or step.num_logprobs:
        return False
    return all(t == 0.0 for t in step.temperatures)


def _kv_caches(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, num_layers: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's zeroed key and value cache. On the CPU all of them share one anonymous
    mapping that Linux may back with 2 MiB pages (transparent huge pages, enabled as
    `madvise` or `always`): decode attention reads every cached block of every sequence each
    step, scattered over the cache, and with 4 KiB pages most of those reads also miss the
    TLB (32 sequences of 192 tokens, 30 layers: 5.3 ms of attention per step with 4 KiB
    pages, 4.4 ms with 2 MiB ones)."""
    if device.type != "cpu":
        return [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
    size = math.prod(shape) * dtype.itemsize  # back to back: padding each to a page of its
    length = 2 * num_layers * size  # own left up to 56 MB of the default 1 GiB unused
    try:
        whole = huge_page_region(length, f"the KV cache for {num_layers} layers")
    except MemoryError as error:
        raise MemoryError(f"{error}: lower --kv-cache-memory-gib or --num-kv-blocks") from error
    # Written now, as torch.zeros does: a page first written inside a step costs a fault there
    # (32 prompts of 128 tokens: 0.28-0.43 s more prefill on a fresh cache). Writing it with
    # torch's threads took 0.03-0.64 s for 1 GiB here, MADV_POPULATE_WRITE 0.47-2.3 s.
    whole.zero_()

    def cache(index: int) -> torch.Tensor:
        offset = index * size
        return whole[offset : offset + size].view(dtype).view(shape)

    return [(cache(2 * layer), cache(2 * layer + 1)) for layer in range(num_layers)]
