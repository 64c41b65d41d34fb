"""Engine configuration: frozen dataclasses, one per concern, built once from kwargs or the CLI.

The whole `EngineConfig` travels to child processes as msgpack (msgspec encodes dataclasses),
so every field is a plain value: a number, a string, or a member of one of the closed sets
below (a `StrEnum`, which travels as its value). `EngineConfig.validate` is the one place
that rejects a value; its `ConfigError` names the field, and the CLI says it with the flag.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import typing
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from otel_engine.sampling_params import parse_override


class Dtype(enum.StrEnum):
    """--dtype (weights and activations) and --kv-cache-dtype (what the KV cache stores);
    auto: model/limits.choose_dtype and choose_kv_cache_dtype."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class ExecutorBackend(enum.StrEnum):
    """Where tensor-parallel ranks run."""

    MP = "mp"  # processes on this machine
    RAY = "ray"  # actors of a Ray cluster


class RayPlacementStrategy(enum.StrEnum):
    """Ray's placement group strategies, by Ray's names."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class KernelsMode(enum.StrEnum):
    AUTO = "auto"  # the fast paths this CPU can run (model/fast_paths.py)
    TORCH = "torch"  # plain torch ops everywhere


class Int4Mode(enum.StrEnum):
    AUTO = "auto"  # a 4-bit checkpoint multiplies by its own weights (model/fast_paths.py)
    OFF = "off"  # copies of every matrix in the model dtype


class QuantActivations(enum.StrEnum):
    """What x is in when it meets GGUF blocks in small steps: 8 bits, or as it is in the model
    dtype (each of those values is for a model of its dtype alone; model/fast_paths.py)."""

    INT8 = "int8"  # quantized per block, integer dot products (as llama.cpp)
    BFLOAT16 = "bfloat16"  # a bfloat16 model's x as it is, by the exact weights
    FLOAT32 = "float32"  # a float32 model's x as it is, by dense float32 copies of them


class GenerationConfigMode(enum.StrEnum):
    """Sampling defaults for the fields a request omits (engine/generation_defaults.py)."""

    AUTO = "auto"  # the model's generation_config.json
    NONE = "none"  # the API's own defaults


class SpeculativeMethod(enum.StrEnum):
    """--speculative-method: where the tokens a step verifies come from (spec/)."""

    NGRAM = "ngram"  # the request's own prompt and output (prompt lookup); no second model
    DRAFT = "draft"  # a smaller model with the same tokenizer (--speculative-model)


class OtlpProtocol(enum.StrEnum):
    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"


class LogFormat(enum.StrEnum):
    JSON = "json"  # one JSON object per line
    CONSOLE = "console"  # for humans


class LogLevel(enum.StrEnum):
    """The root log level, by the logging module's names, in any case (`debug` is DEBUG)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        upper = value.upper() if isinstance(value, str) else None
        return next((member for member in cls if member.value == upper), None)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model, and how to run it. `model` is an HF directory or a .gguf file;
    None means the default model (`model/default_model.DEFAULT_MODEL`)."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: Dtype = Dtype.AUTO
    device: Device = Device.CPU
    max_model_len: int | None = None
    seed: int = 0
    kernels: KernelsMode = KernelsMode.AUTO
    int4: Int4Mode = Int4Mode.AUTO
    quant_activations: QuantActivations = QuantActivations.INT8
    generation_config: GenerationConfigMode = GenerationConfigMode.AUTO
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
    kv_cache_dtype: Dtype = Dtype.AUTO


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (spec/): `speculative_method` None is off. Each decoding
    request may verify up to `num_speculative_tokens` proposed tokens per step, fewer where
    they would not pay: as planned from its measured acceptance and the measured cost of a
    step's size (spec/cost.py). `ngram_min`/`ngram_max`: the
    n-gram lengths prompt lookup matches, longest first; `speculative_model`: the draft
    model of `draft` (an HF directory or .gguf file with the target's tokenizer)."""

    speculative_method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_model: str | None = None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism. `multiprocess` runs the engine core in its own process; the
    default runs it in the caller's (`LLM`, `otel-engine generate`), and `AsyncLLM`, the
    server's engine, always sets it (its core must be a process of its own).
    `distributed_executor_backend`: `mp` spawns the ranks on this machine; `ray` runs them as
    actors of a running Ray cluster (`ray_address`; None: `RAY_ADDRESS`, else the cluster
    started on this machine), placed by a placement group of one bundle per rank
    (`ray_cpus_per_rank` CPUs each, one GPU on CUDA) with `ray_placement_strategy`."""

    tensor_parallel_size: int = 1
    multiprocess: bool = False
    distributed_executor_backend: ExecutorBackend = ExecutorBackend.MP
    ray_address: str | None = None
    ray_placement_strategy: RayPlacementStrategy = RayPlacementStrategy.PACK
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


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """What the server does when its engine fails (engine/recovery.py): `shutdown` fails
    every in-flight request and exits 1; `restart` starts a new engine in the same server
    and carries the in-flight requests over, at most `max_engine_restarts` times in any
    `engine_restart_window` seconds (past that, `shutdown`)."""

    on_engine_failure: EngineFailureMode = EngineFailureMode.SHUTDOWN
    max_engine_restarts: int = 3
    engine_restart_window: float = 600.0


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Telemetry export and log format; None endpoint means the OTEL_* variables decide."""

    otlp_endpoint: str | None = None
    otlp_protocol: OtlpProtocol | None = None
    otlp_logs: bool = False
    log_format: LogFormat = LogFormat.JSON
    log_level: LogLevel = LogLevel.INFO
    log_prompts: bool = False
    crash_history_steps: int = 64  # steps the crash dump's `history` keeps (0: none)
    crash_dump_dir: str | None = None  # also write each crash dump to a file there


MAX_CRASH_HISTORY_STEPS = 256  # a dump lists at most 256 items (redaction.MAX_LIST_ITEMS)
MAX_SPECULATIVE_TOKENS = 16  # proposed tokens one request may verify in a step


class ConfigError(ValueError):
    """A config value that can never work: the `field` (as `EngineConfig.from_kwargs` names
    it), the `rule` it breaks, and the `value`. The CLI says the same with the flag and the
    value as they were typed."""

    def __init__(self, field: str, rule: str, value: Any) -> None:
        self.field, self.rule, self.value = field, rule, value
        super().__init__(f"{field} {rule}, got {value!r}")


def _positive(value: float) -> bool:
    return value > 0  # NaN fails too


# What a number must be, by field; a field left out takes any value of its type.
RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "max_model_len": ("must be positive", _positive),
    "block_size": ("must be a power of two", lambda n: n >= 1 and not n & (n - 1)),
    "num_kv_blocks": ("must be positive", _positive),
    "kv_cache_memory_gib": ("must be positive", _positive),
    "max_num_seqs": ("must be positive", _positive),
    "max_num_batched_tokens": ("must be positive", _positive),
    "num_speculative_tokens": (
        f"must be in [1, {MAX_SPECULATIVE_TOKENS}]",
        lambda n: 1 <= n <= MAX_SPECULATIVE_TOKENS,
    ),
    "ngram_min": ("must be at least 1", lambda n: n >= 1),
    "ngram_max": ("must be at least 1", lambda n: n >= 1),
    "tensor_parallel_size": ("must be at least 1", lambda n: n >= 1),
    "ray_cpus_per_rank": ("must be positive", _positive),
    "engine_ready_timeout": ("must be positive", _positive),
    "step_timeout": ("must be positive", _positive),
    "shutdown_timeout": ("must be positive", _positive),
    "max_engine_restarts": ("must be 0 or more", lambda n: n >= 0),
    "engine_restart_window": ("must be positive", _positive),
    "crash_history_steps": (
        f"must be in [0, {MAX_CRASH_HISTORY_STEPS}]",
        lambda n: 0 <= n <= MAX_CRASH_HISTORY_STEPS,
    ),
}


@functools.cache
def choice_fields() -> dict[str, type[enum.StrEnum]]:
    """Each field whose values are a closed set, and that set (also argparse's choices)."""
    found: dict[str, type[enum.StrEnum]] = {}
    for section in _SECTIONS.values():
        for name, hint in typing.get_type_hints(section).items():
            for kind in typing.get_args(hint) or (hint,):
                if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
                    found[name] = kind
    return found


def _member(name: str, value: Any) -> Any:
    """`value` as a member of the field's closed set when it is one (else as it came, for
    `_check` to refuse)."""
    choices = choice_fields().get(name)
    if choices is None or value is None:
        return value
    try:
        return choices(value)
    except ValueError:
        return value


def _check(name: str, value: Any) -> None:
    if value is None:
        return
    choices = choice_fields().get(name)
    if choices is not None and value not in {m.value for m in choices}:
        raise ConfigError(name, f"must be one of {', '.join(choices)}", value)
    rule = RULES.get(name)
    if rule is not None and not rule[1](value):
        raise ConfigError(name, rule[0], value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine instance needs; `instance_id` keeps IPC names unique."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    instance_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`LLM(model=..., max_num_seqs=...)`); a value
        of a closed set may be given as its string."""
        parts: dict[str, dict[str, Any]] = {}
        for name, section in _SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section)}
            parts[name] = {k: _member(k, kwargs.pop(k)) for k in list(kwargs) if k in names}
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        config = cls(**{name: _SECTIONS[name](**values) for name, values in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        """Reject values that can never work: `ConfigError` names the field and the rule."""
        for section_name in _SECTIONS:
            section = getattr(self, section_name)
            for option in dataclasses.fields(section):
                _check(option.name, getattr(section, option.name))
        parse_override(self.model.override_generation_config)  # its ValueError names the flag
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        """The speculative fields that only work together (named as the flag typed)."""
        spec = self.speculative
        if spec.ngram_min > spec.ngram_max:
            rule = f"must be at most ngram_max ({spec.ngram_max})"
            raise ConfigError("ngram_min", rule, spec.ngram_min)
        is_draft = spec.speculative_method == SpeculativeMethod.DRAFT
        if is_draft and not spec.speculative_model:
            rule = "needs speculative_model (the draft model)"
            raise ConfigError("speculative_method", rule, spec.speculative_method)
        if spec.speculative_model and not is_draft:
            raise ConfigError(
                "speculative_model", "needs speculative_method draft", spec.speculative_model
            )

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=EngineConfig)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
    "timeouts": TimeoutConfig,
    "recovery": RecoveryConfig,
    "observability": ObservabilityConfig,
}
