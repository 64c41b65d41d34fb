"""Sampling defaults for omitted request fields: the model's generation config, the default
model's card values, `--generation-config none`, and `--override-generation-config`, applied
the same way by serve, `LLM`, `otel-engine generate` and `otel-engine replay`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_engine import replay
from otel_engine.cli import build_parser, engine_options, generate_params
from otel_engine.config import EngineConfig
from otel_engine.engine.generation_defaults import (
    apply_generation_defaults,
    for_config,
    parse_override,
    resolve,
)
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from otel_engine.model.default_model import DEFAULT_MODEL


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    generation = {"temperature": 0.6, "top_k": 20, "do_sample": True, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_auto_takes_the_sampling_fields_of_the_generation_config(model_dir: str) -> None:
    defaults = resolve("auto", model_dir, is_default_model=False, override=None)

    assert {"temperature": 0.6, "top_k": 20} == defaults.values
    assert {"generation_config.json"} == set(defaults.sources.values())


def test_none_ignores_the_model(model_dir: str) -> None:
    assert {} == resolve("none", model_dir, is_default_model=False, override=None).values


def test_the_default_model_gets_its_card_values(tmp_path: Path) -> None:
    """Its GGUF carries no generation config: the model card's temperature and top_p."""
    defaults = resolve("auto", str(tmp_path), is_default_model=True, override=None)

    assert (
        dict(DEFAULT_MODEL.card_defaults) == defaults.values == {"temperature": 0.2, "top_p": 0.9}
    )
    assert {"default model card"} == set(defaults.sources.values())


def test_override_wins_field_by_field(model_dir: str) -> None:
    override = parse_override('{"temperature": 0.9, "min_p": 0.1}')
    defaults = resolve("auto", model_dir, is_default_model=False, override=override)

    assert {"temperature": 0.9, "top_k": 20, "min_p": 0.1} == defaults.values
    assert "--override-generation-config" == defaults.sources["temperature"]


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1]",
        '{"temprature": 0.5}',
        '{"temperature": "hot"}',
        '{"top_p": true}',
        '{"temperature": 5}',
        '{"top_p": 0}',
        '{"top_k": -2}',
        '{"top_k": 2.5}',
    ],
)
def test_bad_overrides_fail_at_startup_naming_the_problem(text: str) -> None:
    with pytest.raises(ValueError, match="--override-generation-config"):
        EngineConfig.from_kwargs(override_generation_config=text)


def test_omitted_fields_take_the_defaults_and_sent_ones_stay() -> None:
    """Only fields the request did not send; one sent at the API default value stays."""
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    omitted = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(8, defaults)
    sent = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "top_k": 0}
    ).to_sampling_params(8, defaults)

    assert (0.2, 0.9, 40) == (omitted.temperature, omitted.top_p, omitted.top_k)
    assert (1.0, 0.9, 0) == (sent.temperature, sent.top_p, sent.top_k)


@pytest.mark.slow  # starts an engine
def test_offline_generate_without_params_takes_the_model_defaults(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Issue 24: `LLM.generate(prompts)` samples with the model's generation config, as the
    server does for requests that omit the fields (it used to sample at temperature 1.0):
    with a generation config that says temperature 0, the output is the greedy one."""
    import shutil

    from otel_engine import LLM, SamplingParams

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    path = copy / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, "temperature": 0.0, "top_k": 5}))
    with LLM(str(copy)) as llm:
        defaults = llm.default_sampling_params()
        sampled = [llm.generate(["Once upon a time"])[0].outputs[0].token_ids for _ in range(2)]
        greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0))

    assert (0.0, 5) == (defaults.temperature, defaults.top_k)
    assert sampled[0] == sampled[1] == greedy[0].outputs[0].token_ids


def test_a_generation_config_out_of_range_fails_at_start_naming_the_file(tmp_path: Path) -> None:
    """Issue 24: a model's default no request could send (temperature 5) is refused when
    the engine starts, not answered as a 400 for a field the client never sent."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 5.0}))

    with pytest.raises(ValueError, match=r"generation_config\.json: temperature must be in"):
        resolve("auto", str(tmp_path), is_default_model=False, override=None)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("kv_cache_memory_gib", 0),
        ("kv_cache_memory_gib", -1.0),
        ("kv_cache_memory_gib", float("nan")),
        ("num_kv_blocks", 0),
        ("max_model_len", 0),
    ],
)
def test_engine_sizes_that_cannot_work_fail_at_start(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{option} must be positive"):
        EngineConfig.from_kwargs(**{option: value})


def test_apply_generation_defaults_fills_only_the_fields_not_given() -> None:
    """A given field keeps its value (even the API default); a default fills the rest."""
    params = apply_generation_defaults(
        {"max_tokens": 5, "temperature": 1.0}, {"temperature": 0.2, "top_k": 40.0}
    )

    assert (5, 1.0, 40) == (params.max_tokens, params.temperature, params.top_k)
    assert isinstance(params.top_k, int)


OVERRIDE = ("--override-generation-config", '{"temperature": 0.3, "top_k": 7}')


def _defaults(argv: list[str], model_dir: str) -> dict[str, float]:
    """The generation defaults an engine started by `argv` over `model_dir` resolves."""
    args = build_parser().parse_args(argv)
    config = EngineConfig.from_kwargs(**engine_options(args))
    return for_config(config, model_dir).values


def test_serve_override_reaches_a_request_that_omits_the_fields(model_dir: str) -> None:
    defaults = _defaults(["serve", "--model", model_dir, *OVERRIDE], model_dir)

    params = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(8, defaults)

    assert (0.3, 7) == (params.temperature, params.top_k)


def test_generate_override_reaches_the_params(model_dir: str) -> None:
    """`generate` without --temperature samples as the override says (it used to ignore the
    flag and sample greedily)."""
    argv = ["generate", "--model", model_dir, *OVERRIDE, "hi"]

    params = generate_params(build_parser().parse_args(argv), _defaults(argv, model_dir))

    assert (0.3, 7, 64) == (params.temperature, params.top_k, params.max_tokens)


def test_generate_temperature_flag_wins_over_the_defaults(model_dir: str) -> None:
    argv = ["generate", "--model", model_dir, *OVERRIDE, "--temperature", "0", "hi"]

    params = generate_params(build_parser().parse_args(argv), _defaults(argv, model_dir))

    assert (0.0, 7) == (params.temperature, params.top_k)


def test_generate_without_flags_takes_the_model_generation_config(model_dir: str) -> None:
    argv = ["generate", "--model", model_dir, "hi"]

    params = generate_params(build_parser().parse_args(argv), _defaults(argv, model_dir))

    assert (0.6, 20) == (params.temperature, params.top_k)


def test_replay_override_wins_over_the_dumped_values(model_dir: str) -> None:
    """A replayed request keeps the values its dump shows (what ran), but for the fields
    the replay's --override-generation-config sets."""
    argv = ["replay", "dump.json", *OVERRIDE]
    overrides = engine_options(build_parser().parse_args(argv))
    dump_engine = {"model": {"model": model_dir, "override_generation_config": None}}
    options = replay.engine_options({"engine": dump_engine}, None, overrides)
    defaults = for_config(EngineConfig.from_kwargs(**options), model_dir).values
    dumped = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.5, "top_k": 0, "min_p": 0.0}

    params = replay.request_params(dumped, defaults, replay.overridden_fields(overrides))

    assert (0.3, 7, 0.5, 8) == (params.temperature, params.top_k, params.top_p, params.max_tokens)
