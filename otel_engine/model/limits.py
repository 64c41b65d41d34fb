"""What a model and a config allow: the KV cache's size, the context length, the dtype,
whether the heads split across the ranks. The limits are resolved once, in the engine core
(`resolve_limits`), and handed to every rank's runner and to the front end, so every process
runs with the same ones. No torch here: the engine core process uses it without loading
torch (at TP > 1 it runs no model)."""

from __future__ import annotations

import enum

import msgspec

from otel_engine.config import Device, Dtype, EngineConfig
from otel_engine.model.arch import ModelArch
from otel_engine.model.cpu import half_precision_blocker

DTYPE_BYTES: dict[str, int] = {Dtype.FLOAT32: 4, Dtype.BFLOAT16: 2, Dtype.FLOAT16: 2}


class LimitedBy(enum.StrEnum):
    """What set the context length (`EngineLimits.limited_by`); `validation.describe_context`
    says it in words."""

    MODEL = "model"  # the model's max_position_embeddings
    MAX_MODEL_LEN = "max_model_len"  # --max-model-len
    SLIDING_WINDOW = "sliding_window"  # attention here does not slide: the window is the end
    KV_CACHE = "kv_cache"  # the KV budget holds fewer tokens


class EngineLimits(msgspec.Struct, frozen=True, array_like=True):
    """Sizes resolved once from the config and the model (`resolve_limits`), the same in
    every process: what the runners size their KV caches by and the front end checks
    requests against."""

    num_kv_blocks: int
    max_model_len: int
    limited_by: LimitedBy = LimitedBy.MODEL  # what set max_model_len

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> EngineLimits:
        return msgspec.msgpack.decode(data, type=EngineLimits)


class DtypeChoice(msgspec.Struct, frozen=True):
    """The dtype the model runs in and why (the start log `kernels.selected` says both)."""

    name: str
    reason: str


def choose_dtype(config: EngineConfig, arch: ModelArch) -> DtypeChoice:
    """The flag; for `auto` the checkpoint's dtype (else float32), except that a
    half-precision checkpoint runs in float32 on a CPU that only emulates its arithmetic."""
    name = config.model.dtype
    if name != Dtype.AUTO:
        return DtypeChoice(name, "--dtype")
    stored = arch.torch_dtype if arch.torch_dtype in DTYPE_BYTES else Dtype.FLOAT32
    if stored == Dtype.FLOAT32 or config.model.device != Device.CPU:
        return DtypeChoice(stored, f"auto: the checkpoint's {stored}")
    blocker = half_precision_blocker(stored)
    if blocker is not None:
        return DtypeChoice(Dtype.FLOAT32, f"auto: the checkpoint's {stored}, but {blocker}")
    return DtypeChoice(stored, f"auto: the checkpoint's {stored}, which this CPU computes in")


HALF_PRECISION = (Dtype.BFLOAT16, Dtype.FLOAT16)


def choose_kv_cache_dtype(config: EngineConfig, arch: ModelArch) -> DtypeChoice:
    """What the KV cache stores: the flag, or for `auto` the dtype the model runs in, except
    float16 for a half-precision checkpoint run in float32 (a CPU without bfloat16
    arithmetic, or --dtype float32): the checkpoint's values held 16 bits wide, as
    llama.cpp's default f16 cache holds them, in half the memory and half the reads of each
    decode step. A float16 cache is taken by float32 models alone (the compiled kernels
    convert on write and read); any other cache must be the model's own dtype."""
    model = choose_dtype(config, arch).name
    name = config.cache.kv_cache_dtype
    if name == Dtype.AUTO:
        stored = arch.torch_dtype
        if model == Dtype.FLOAT32 and stored in HALF_PRECISION:
            return DtypeChoice(
                Dtype.FLOAT16, f"auto: a {stored} checkpoint run in float32 keeps its KV in 16 bits"
            )
        return DtypeChoice(model, "auto: the model's dtype")
    if name != model and not (name == Dtype.FLOAT16 and model == Dtype.FLOAT32):
        raise ValueError(
            f"--kv-cache-dtype {name} does not go with the model's {model}: choose {model}"
            + (" or float16" if model == Dtype.FLOAT32 else "")
        )
    return DtypeChoice(name, "--kv-cache-dtype")


def check_tensor_parallel(arch: ModelArch, tp_size: int) -> None:
    """Fail early, with the numbers, when the heads cannot be split across `tp_size` ranks."""
    problems = []
    if arch.num_attention_heads % tp_size:
        problems.append(f"{arch.num_attention_heads} attention heads")
    if arch.num_key_value_heads % tp_size:
        problems.append(f"{arch.num_key_value_heads} key/value heads")
    if arch.intermediate_size % tp_size:
        problems.append(f"an MLP size of {arch.intermediate_size}")
    if arch.num_experts and arch.moe_intermediate_size % tp_size:
        problems.append(f"an expert MLP size of {arch.moe_intermediate_size}")
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the model's "
            f"{' and '.join(problems)}; choose a size that divides them"
        )


def resolve_limits(config: EngineConfig, arch: ModelArch) -> EngineLimits:
    """KV blocks from the flag or the memory budget (at the KV cache's dtype); context length
    capped by both."""
    tp = config.parallel.tensor_parallel_size
    check_tensor_parallel(arch, tp)
    block_size = config.cache.block_size
    kv_dtype = choose_kv_cache_dtype(config, arch)  # a pairing it refuses fails the start here
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        itemsize = DTYPE_BYTES[kv_dtype.name]
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
    limited_by = LimitedBy.MAX_MODEL_LEN if config.model.max_model_len else LimitedBy.MODEL
    if max_len > arch.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len} exceeds the model's "
            f"max_position_embeddings {arch.max_position_embeddings}"
        )
    if arch.sliding_window and max_len > arch.sliding_window and not arch.sliding_layers:
        # Attention here sees the whole context; within the window that is what the model
        # computes, beyond it it is not: the context stops at the window.
        max_len, limited_by = arch.sliding_window, LimitedBy.SLIDING_WINDOW
    if num_blocks * block_size < max_len:
        max_len, limited_by = num_blocks * block_size, LimitedBy.KV_CACHE
    return EngineLimits(num_kv_blocks=num_blocks, max_model_len=max_len, limited_by=limited_by)
