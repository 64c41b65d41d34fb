"""The model runner: loads one rank's shard, owns its KV cache, runs a step's forward.

Used inside the engine core at TP=1 and inside each worker process at TP>1; the same
`ModelInput` drives both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from otel_engine.config import EngineConfig
from otel_engine.ipc.messages import ModelInput
from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.llama import LlamaModel, check_tensor_parallel
from otel_engine.model.loader import ModelArch, iter_int4, iter_weights, load_model_arch
from otel_engine.model.sampler import Sampler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig, arch: ModelArch) -> torch.dtype:
    name = config.model.dtype
    if name == "auto":
        name = arch.torch_dtype if arch.torch_dtype in _DTYPES else "float32"
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Sizes derived once from config and model, identical in every process."""

    num_kv_blocks: int
    max_model_len: int


def resolve_limits(config: EngineConfig, arch: ModelArch) -> EngineLimits:
    """KV blocks from the flag or the memory budget; context length capped by both."""
    tp = config.parallel.tensor_parallel_size
    check_tensor_parallel(arch, tp)
    block_size = config.cache.block_size
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        itemsize = torch.empty((), dtype=resolve_dtype(config, arch)).element_size()
        per_block = (
            2
            * arch.num_hidden_layers
            * block_size
            * (arch.num_key_value_heads // tp)
            * arch.head_dim
            * itemsize
        )
        num_blocks = max(1, int(config.cache.kv_cache_memory_gib * 2**30) // per_block)
    max_len = config.model.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len} exceeds the model's "
            f"max_position_embeddings {arch.max_position_embeddings}"
        )
    max_len = min(max_len, num_blocks * block_size)
    return EngineLimits(num_kv_blocks=num_blocks, max_model_len=max_len)


class ModelRunner:
    """One rank's model, KV cache and (on rank 0) sampler."""

    def __init__(self, config: EngineConfig, model_dir: str, *, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.arch = load_model_arch(model_dir)
        self.limits = resolve_limits(config, self.arch)
        self.device = torch.device(
            config.model.device if config.model.device == "cpu" else f"cuda:{rank}"
        )
        self.dtype = resolve_dtype(config, self.arch)
        self.block_size = config.cache.block_size
        self.model = LlamaModel(
            self.arch,
            dtype=self.dtype,
            device=self.device,
            tp_rank=rank,
            tp_size=config.parallel.tensor_parallel_size,
            max_positions=self.limits.max_model_len,
            kernels=config.model.kernels,
            block_size=self.block_size,
        )
        self.model.load_weights(iter_weights(model_dir))
        self._load_int4(model_dir)
        shape = (
            self.model.num_kv_heads,
            self.limits.num_kv_blocks,
            self.block_size,
            self.model.head_dim,
        )
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.arch.num_hidden_layers)
        ]
        self.sampler = Sampler(self.device, config.model.seed) if rank == 0 else None

    def _load_int4(self, model_dir: str) -> None:
        """The checkpoint's 4-bit weights for small steps, where they apply (--int4)."""
        model = self.model
        if self.config.model.int4 == "off" or not model.is_packed or self.dtype != torch.bfloat16:
            return
        weights = iter_int4(model_dir)
        if not weights:
            return
        reason = model.load_int4(weights)
        logger.info(
            "model.int4", extra={"enabled": reason is None, "reason": reason, "rank": self.rank}
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
    def execute(self, step: ModelInput) -> list[int]:
        """Run the forward; rank 0 returns one sampled token per sampled sequence."""
        device = self.device
        input_ids, meta = self.forward_inputs(step)
        hidden = self.model.forward(input_ids, self.kv_caches, meta)
        if self.sampler is None or not step.sample_indices:
            return []
        ends = torch.tensor(step.query_lens, device=device).cumsum(0) - 1
        rows = ends[torch.tensor(step.sample_indices, dtype=torch.long, device=device)]
        logits = self.model.compute_logits(hidden[rows])
        return self.sampler(
            logits, step.temperatures, step.top_ps, step.top_ks, step.seeds, step.output_positions
        )


def prepare_model_input(
    step_id: int, chunks: list, block_size: int, trace_context: dict[str, str] | None = None
) -> ModelInput:
    """Flatten a scheduler output (decodes first) into the message every rank receives."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens, seq_lens, block_tables, sample_indices = [], [], [], []
    temperatures, top_ps, top_ks, seeds, output_positions = [], [], [], [], []
    num_decodes = 0
    for index, chunk in enumerate(chunks):
        request = chunk.request
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if chunk.num_tokens == 1 and index == num_decodes:
            num_decodes += 1
        input_ids += request.token_ids(start, end)
        positions += range(start, end)
        blocks = request.block_ids
        slot_mapping += [
            blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
        ]
        query_lens.append(chunk.num_tokens)
        seq_lens.append(end)
        block_tables.append(blocks)
        if end == request.num_tokens:
            params = request.sampling_params
            sample_indices.append(index)
            temperatures.append(0.0 if params.is_greedy else params.temperature)
            top_ps.append(params.top_p)
            top_ks.append(params.top_k)
            seeds.append(params.seed)
            output_positions.append(request.num_output_tokens)
    return ModelInput(
        step_id=step_id,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_indices=sample_indices,
        temperatures=temperatures,
        top_ps=top_ps,
        top_ks=top_ks,
        seeds=seeds,
        output_positions=output_positions,
        trace_context=trace_context or {},
    )
