"""Speculative decoding seen from outside: a real server with the draft model method (the
tiny model as its own draft), a real OTLP receiver and /metrics; and a draft model that
fails in a step, as an operator would see it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.procs import ServerProcess
from tests.observability.conftest import clean_env

pytestmark = pytest.mark.slow  # servers

MODEL = "tiny"


def _server(model_dir: str, log_path: Path, *extra: str, env: dict[str, str]) -> ServerProcess:
    args = ["--model", model_dir, "--served-model-name", MODEL, "--dtype", "float32"]
    args += ["--speculative-method", "draft", "--speculative-model", model_dir]
    args += ["--log-format", "json", "--num-kv-blocks", "128", "--shutdown-timeout", "10"]
    server = ServerProcess([*args, *extra], log_path=log_path)
    server.env = {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return server


@pytest.fixture(scope="module")
def run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A speculating server that answered two requests and was stopped."""
    log_dir = tmp_path_factory.mktemp("spec-serve")
    with OtlpReceiver("grpc") as receiver:
        env = clean_env(**receiver.env(), OTEL_BSP_SCHEDULE_DELAY="600000")
        server = _server(
            tiny_model_dir, log_dir / "serve.log", "--vllm-metric-names", env=env
        ).start()
        try:
            server.wait_healthy()
            with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
                body = {
                    "model": MODEL,
                    "prompt": "the engine schedules requests in steps",
                    "max_tokens": 24,
                    "temperature": 0.8,
                    "seed": 4,
                    "n": 2,
                    "logprobs": 2,
                    "ignore_eos": True,
                }
                completion = client.post("/v1/completions", json=body)
                metrics = client.get("/metrics").text
            server.terminate()
            code = server.wait(timeout=60)
        finally:
            server.cleanup()
        yield {
            "completion": completion,
            "metrics": metrics,
            "code": code,
            "spans": receiver.spans(),
            "logs": server.json_lines(),
        }


def test_the_answer_is_whole(run: dict[str, Any]) -> None:
    completion = run["completion"]
    assert 200 == completion.status_code, completion.text
    choices = completion.json()["choices"]
    assert 2 == len(choices)
    for choice in choices:
        assert 24 == len(choice["logprobs"]["tokens"])  # one entry per token, kept or not
    assert 24 * 2 == completion.json()["usage"]["completion_tokens"]
    assert 0 == run["code"]


def test_the_request_span_and_log_line_count_proposals(run: dict[str, Any]) -> None:
    [span] = [s for s in run["spans"] if s["name"].startswith("text_completion ")]
    attributes = span["attributes"]
    proposed = attributes["otel_engine.request.spec_proposed_tokens"]
    accepted = attributes["otel_engine.request.spec_accepted_tokens"]
    assert attributes["otel_engine.request.spec_method"] == "draft"
    assert 0 < accepted <= proposed
    assert attributes["otel_engine.request.spec_acceptance_rate"] == pytest.approx(
        accepted / proposed, abs=1e-4
    )
    [line] = [r for r in run["logs"] if r.get("event") == "request.finished"]
    assert (line["spec_proposed_tokens"], line["spec_accepted_tokens"]) == (proposed, accepted)
    assert line["spec_method"] == "draft"


def test_step_spans_carry_the_verified_positions(run: dict[str, Any]) -> None:
    steps = [s["attributes"] for s in run["spans"] if s["name"] == "engine_core.step"]
    verifying = [a for a in steps if a.get("otel_engine.step.num_draft_tokens")]
    assert verifying
    for attributes in verifying:
        drafts = attributes["otel_engine.step.num_draft_tokens"]
        positions = attributes["otel_engine.step.num_verified_positions"]
        assert positions > drafts  # one per proposal, plus one per request
        assert 0 <= attributes["otel_engine.step.num_accepted_tokens"] <= drafts


def _sample(text: str, name: str) -> float:
    """The one sample `name` labelled method="draft"."""
    [value] = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels.get("method") == "draft"
    ]
    return float(value)


def test_metrics_count_proposals_under_both_names(run: dict[str, Any]) -> None:
    text = run["metrics"]
    proposed = _sample(text, "otel_engine_spec_decode_proposed_tokens_total")
    accepted = _sample(text, "otel_engine_spec_decode_accepted_tokens_total")
    assert 0 < accepted <= proposed
    assert _sample(text, "vllm:spec_decode_num_draft_tokens_total") == proposed
    assert _sample(text, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    verifications = _sample(text, "otel_engine_spec_decode_verifications_total")
    assert 0 < verifications <= proposed
    assert _sample(text, "vllm:spec_decode_num_drafts_total") == verifications
    # One request (its two choices' counts summed), as every request metric counts it.
    assert _sample(text, "otel_engine_spec_decode_acceptance_rate_count") == 1


def test_a_failing_draft_model_fails_the_engine_in_order(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """The draft model raises in its first forward: the client's error and the crash dump
    name it, the dump holds the speculative settings and each request's counts, the server
    exits 1."""
    dump_dir = tmp_path / "dumps"
    env = clean_env(OTEL_ENGINE_FAULT="engine_core:raise:phase=draft:when=num_requests>=1")
    server = _server(
        tiny_model_dir, tmp_path / "serve.log", "--crash-dump-dir", str(dump_dir), env=env
    ).start()
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 20, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
        code = server.wait(timeout=60)
    finally:
        server.cleanup()

    assert 500 <= response.status_code < 600, response.text
    assert "DraftModelError" in response.text
    assert 1 == code
    [path] = sorted(dump_dir.glob("crash-*.json"))
    dump = json.loads(path.read_text())
    speculative = dump["engine_config"]["speculative"]
    assert speculative["method"] == "draft"
    assert speculative["draft_model"] == Path(tiny_model_dir).name
    assert f"the draft model {Path(tiny_model_dir).name} failed" in json.dumps(dump)
    [request] = dump["scheduler_output"]["requests"]
    assert request["spec"]["history"] is True  # only that it exists: token ids never leave
    assert request["spec"]["num_proposed"] == 0
    assert request["num_draft_tokens"] == 0  # the draft failed before it proposed
