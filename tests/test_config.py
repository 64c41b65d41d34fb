"""The engine config: closed sets as enums that travel as their strings, one table of
rules, and errors in the words of whoever gave the value (the flag, or the field)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from otel_engine.cli import ENGINE_FLAGS, RECOVERY_FLAGS, build_parser, main
from otel_engine.config import (
    ConfigError,
    Dtype,
    EngineConfig,
    ModelConfig,
    OtlpProtocol,
    choice_fields,
)

# A bad value for every engine and recovery flag, and what the error must say: the flag as
# typed and the value as typed. argparse refuses what its types and choices refuse; the
# rest is `EngineConfig.validate`'s.
BAD_VALUES: dict[str, tuple[list[str], str]] = {
    "model": (["--model"], "argument --model: expected one argument"),
    "served_model_name": (["--served-model-name"], "argument --served-model-name: expected one"),
    "dtype": (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    "device": (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    "max_model_len": (["--max-model-len", "0"], "--max-model-len must be positive, got 0"),
    "seed": (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    "kernels": (["--kernels", "fast"], "argument --kernels: invalid choice: 'fast'"),
    "int4": (["--int4", "on"], "argument --int4: invalid choice: 'on'"),
    "quant_activations": (
        ["--quant-activations", "int4"],
        "argument --quant-activations: invalid choice: 'int4'",
    ),
    "generation_config": (
        ["--generation-config", "file"],
        "argument --generation-config: invalid choice: 'file'",
    ),
    "override_generation_config": (
        ["--override-generation-config", "[1]"],
        "--override-generation-config must be a JSON object",
    ),
    "block_size": (["--block-size", "3"], "--block-size must be a power of two, got 3"),
    "enable_prefix_caching": (
        ["--enable-prefix-caching=1"],
        "argument --enable-prefix-caching/--no-enable-prefix-caching: ignored explicit "
        "argument '1'",
    ),
    "num_kv_blocks": (["--num-kv-blocks", "0"], "--num-kv-blocks must be positive, got 0"),
    "kv_cache_memory_gib": (
        ["--kv-cache-memory-gib", "0"],
        "--kv-cache-memory-gib must be positive, got 0",
    ),
    "kv_cache_dtype": (["--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice"),
    "max_num_seqs": (["--max-num-seqs", "0"], "--max-num-seqs must be positive, got 0"),
    "max_num_batched_tokens": (
        ["--max-num-batched-tokens=-1"],
        "--max-num-batched-tokens must be positive, got -1",
    ),
    "speculative_method": (
        ["--speculative-method", "eagle"],
        "argument --speculative-method: invalid choice: 'eagle'",
    ),
    "num_speculative_tokens": (
        ["--num-speculative-tokens", "17"],
        "--num-speculative-tokens must be in [1, 16], got 17",
    ),
    "ngram_min": (["--ngram-min", "0"], "--ngram-min must be at least 1, got 0"),
    "ngram_max": (["--ngram-max", "0"], "--ngram-max must be at least 1, got 0"),
    "speculative_model": (
        ["--speculative-model", "draft.gguf"],
        "--speculative-model needs speculative_method draft, got draft.gguf",
    ),
    "tensor_parallel_size": (
        ["--tensor-parallel-size", "0"],
        "--tensor-parallel-size must be at least 1, got 0",
    ),
    "distributed_executor_backend": (
        ["--distributed-executor-backend", "slurm"],
        "argument --distributed-executor-backend: invalid choice: 'slurm'",
    ),
    "ray_address": (["--ray-address"], "argument --ray-address: expected one argument"),
    "ray_placement_strategy": (
        ["--ray-placement-strategy", "pack"],
        "argument --ray-placement-strategy: invalid choice: 'pack'",
    ),
    "ray_cpus_per_rank": (
        ["--ray-cpus-per-rank", "0"],
        "--ray-cpus-per-rank must be positive, got 0",
    ),
    "engine_ready_timeout": (
        ["--engine-ready-timeout", "0"],
        "--engine-ready-timeout must be positive, got 0",
    ),
    "step_timeout": (["--step-timeout", "nan"], "--step-timeout must be positive, got nan"),
    "shutdown_timeout": (
        ["--shutdown-timeout", "-1"],
        "--shutdown-timeout must be positive, got -1",
    ),
    "otlp_endpoint": (["--otlp-endpoint"], "argument --otlp-endpoint: expected one argument"),
    "otlp_protocol": (["--otlp-protocol", "http"], "argument --otlp-protocol: invalid choice"),
    "log_format": (["--log-format", "text"], "argument --log-format: invalid choice: 'text'"),
    "log_level": (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    "otlp_logs": (["--otlp-logs=yes"], "argument --otlp-logs: ignored explicit argument 'yes'"),
    "log_prompts": (
        ["--log-prompts=yes"],
        "argument --log-prompts: ignored explicit argument 'yes'",
    ),
    "crash_history_steps": (
        ["--crash-history-steps", "257"],
        "--crash-history-steps must be in [0, 256], got 257",
    ),
    "crash_dump_dir": (["--crash-dump-dir"], "argument --crash-dump-dir: expected one argument"),
    "on_engine_failure": (
        ["--on-engine-failure", "retry"],
        "argument --on-engine-failure: invalid choice: 'retry'",
    ),
    "max_engine_restarts": (
        ["--max-engine-restarts", "-1"],
        "--max-engine-restarts must be 0 or more, got -1",
    ),
    "engine_restart_window": (
        ["--engine-restart-window", "0"],
        "--engine-restart-window must be positive, got 0",
    ),
}


def test_every_engine_and_recovery_flag_has_a_bad_value_case() -> None:
    """A new flag fails here until it has its case below."""
    assert set(ENGINE_FLAGS + RECOVERY_FLAGS) == set(BAD_VALUES)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_a_bad_flag_value_is_named_as_typed(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    tokens, expected = BAD_VALUES[name]
    with pytest.raises(SystemExit) as exited:
        main(["serve", *tokens])

    assert 2 == exited.value.code
    assert expected in capsys.readouterr().err


def test_the_last_of_a_repeated_flag_is_the_one_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--block-size", "16", "--block-size=12"])

    assert "--block-size must be a power of two, got 12" in capsys.readouterr().err


def test_the_python_api_names_the_field() -> None:
    with pytest.raises(ConfigError) as raised:
        EngineConfig.from_kwargs(kv_cache_memory_gib=0)

    assert ("kv_cache_memory_gib", "must be positive", 0) == (
        raised.value.field,
        raised.value.rule,
        raised.value.value,
    )
    assert "kv_cache_memory_gib must be positive, got 0" == str(raised.value)


def test_a_value_outside_a_closed_set_names_its_members() -> None:
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig.from_kwargs(dtype="int8")


def test_a_closed_set_given_as_its_string_becomes_its_member() -> None:
    config = EngineConfig.from_kwargs(dtype="float32", otlp_protocol="http/protobuf")

    assert Dtype.FLOAT32 is config.model.dtype
    assert OtlpProtocol.HTTP_PROTOBUF is config.observability.otlp_protocol


def test_the_config_travels_as_the_same_strings() -> None:
    """Child processes decode the config: a member encodes as the string it stands for."""
    members = EngineConfig.from_kwargs(dtype="bfloat16", kernels="torch")
    strings = dataclasses.replace(
        members,
        model=dataclasses.replace(ModelConfig(), dtype="bfloat16", kernels="torch"),
    )

    assert strings.encode() == members.encode()
    assert Dtype.BFLOAT16 is EngineConfig.decode(members.encode()).model.dtype


def test_the_flags_offer_exactly_each_closed_set() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in commands.choices["serve"]._actions}

    offered = {name: list(actions[name].choices or ()) for name in choice_fields()}

    assert {name: [m.value for m in kind] for name, kind in choice_fields().items()} == offered


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (
            ["--speculative-method", "draft"],
            "--speculative-method needs speculative_model (the draft model), got draft",
        ),
        (["--ngram-min", "5", "--ngram-max", "3"], "--ngram-min must be at most ngram_max (3)"),
    ],
)
def test_speculative_flags_that_only_work_together(
    tokens: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *tokens])

    assert 2 == exited.value.code
    assert expected in capsys.readouterr().err
