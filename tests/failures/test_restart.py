"""`--on-engine-failure restart`: an engine failure is, for the clients, a pause.

Each row starts `otel-engine serve` on the tiny model with restarts on, sends a crowd of
requests at once (greedy, seeded sampling, logprobs, n=2, penalties, a stop string; streamed
and not), and makes the engine fail while they run: by `OTEL_ENGINE_FAULT` in the first
engine only (`restart=0`), or by SIGKILL from outside. Every client must get exactly what
the same requests got from a server where nothing failed (text, finish reasons, usage,
logprobs), the server must keep running and serving, the failure must still leave its one
crash dump, and the failed engine's processes must be gone.

A poison request (one whose prompt makes the engine fail at every step that schedules it,
`when=prompt_len>=N`) must fail alone with `engine_fault_request` after two failures, while
the others finish as without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.failures.conftest import ProcessWatch, wait_exit
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.procs import ServerProcess, is_alive

pytestmark = pytest.mark.slow  # starts servers

FAULT_STEP = 12  # every request has joined; none can have finished (MAX_TOKENS steps)
MAX_TOKENS = 48
CLIENT_TIMEOUT_S = 90.0
RESTART = ("--on-engine-failure", "restart")

PROMPTS = (
    "The engine restarts in place and every stream goes on.",
    "A pause in the stream, not an error.",
    "Tokens already sent are computed again, never sent again.",
)
BODIES: list[dict[str, Any]] = [
    {"prompt": PROMPTS[0], "temperature": 0},
    {"prompt": PROMPTS[1], "temperature": 0.9, "seed": 7},
    {"prompt": PROMPTS[2], "temperature": 0, "logprobs": 2},
    {"prompt": PROMPTS[0], "temperature": 0.8, "seed": 11, "n": 2},
    {"prompt": PROMPTS[1], "temperature": 0.7, "seed": 3, "presence_penalty": 0.6},
    {"prompt": PROMPTS[2], "temperature": 0, "frequency_penalty": 0.4, "stop": ["ee"]},
    {  # structured output: the grammar is advanced over the tokens already sent
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "temperature": 0.6,
        "seed": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {
                    "type": "object",
                    "properties": {"line": {"type": "string"}, "count": {"type": "integer"}},
                    "required": ["line", "count"],
                },
            },
        },
    },
]


def _body(body: dict[str, Any]) -> dict[str, Any]:
    return {"max_tokens": MAX_TOKENS, "ignore_eos": True, **body}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The token counts (the prefix cache's hits depend on arrival order: left out)."""
    if usage is None:
        return None
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"])
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion, put together: per choice its text, finish reason and logprob
    tokens; the usage; or the error event."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    tokens: dict[int, list[str]] = {}
    usage = error = None
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", _path(body), json=request) as response:
        if response.status_code != 200:
            body = json.loads(await response.aread())
            return {"status": response.status_code, "error": body.get("error")}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
                continue
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                index = choice["index"]
                texts[index] = texts.get(index, "") + _text(choice)
                reasons[index] = choice.get("finish_reason") or reasons.get(index)
                if choice.get("logprobs"):
                    tokens.setdefault(index, []).extend(choice["logprobs"]["tokens"])
    if error is not None:
        return {"status": 200, "error": error}
    return {"texts": texts, "reasons": reasons, "tokens": tokens, "usage": _usage(usage)}


async def _full(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(_path(body), json=body)
    payload = response.json()
    if response.status_code != 200:
        return {"status": response.status_code, "error": payload.get("error")}
    choices = payload["choices"]
    return {
        "texts": {c["index"]: _text(c) for c in choices},
        "reasons": {c["index"]: c["finish_reason"] for c in choices},
        "tokens": {c["index"]: c["logprobs"]["tokens"] for c in choices if c.get("logprobs")},
        "usage": _usage(payload["usage"]),
    }


async def _crowd(base_url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every body twice at once, streamed and not."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits, trust_env=False
    ) as client:
        calls = [_stream(client, _body(b)) for b in bodies] + [
            _full(client, _body(b)) for b in bodies
        ]
        return list(await asyncio.gather(*calls))


def run_crowd(base_url: str, bodies: list[dict[str, Any]] = BODIES) -> list[dict[str, Any]]:
    return asyncio.run(_crowd(base_url, bodies))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str) -> list[dict[str, Any]]:
    """What the crowd gets from a server where nothing fails."""
    server = ServerProcess(_args(tiny_model_dir)).start()
    try:
        server.wait_healthy(timeout=120)
        return run_crowd(server.base_url)
    finally:
        server.cleanup()


def _args(model_dir: str, *extra: str) -> list[str]:
    return ["--model", model_dir, "--num-kv-blocks", "256", *RESTART, *extra]


def _metric(base_url: str, name: str) -> float:
    """The sum of a counter family's samples on /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _events(server: ServerProcess, event: str) -> list[dict[str, Any]]:
    return [record for record in server.json_lines() if record.get("event") == event]


def _core(watch: ProcessWatch) -> psutil.Process:
    return watch.find("otel-engine-core", timeout=30)


def _kill_core_when_hung(server: ServerProcess, watch: ProcessWatch) -> None:
    """Wait for the hang fault's log line, then SIGKILL the engine core (as the OOM killer
    would)."""
    deadline = time.monotonic() + 60
    while not _events(server, "fault.injected"):
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.05)
    os.kill(_core(watch).pid, signal.SIGKILL)


ROWS = [
    pytest.param(f"engine_core:raise:step={FAULT_STEP}:restart=0", (), "InjectedFault", id="raise"),
    pytest.param(
        f"worker:oom:step={FAULT_STEP}:restart=0", (), "InjectedOutOfMemoryError", id="oom"
    ),
    pytest.param(f"worker:exit:step={FAULT_STEP}:restart=0", (), "EngineCoreDied", id="exit"),
    pytest.param(
        f"worker:segfault:step={FAULT_STEP}:restart=0", (), "EngineCoreDied", id="segfault"
    ),
    pytest.param(
        f"worker:hang:step={FAULT_STEP}:restart=0",
        ("--step-timeout", "3"),
        "StepTimeout",
        id="hang",
    ),
    pytest.param(
        f"worker:hang:step={FAULT_STEP}:restart=0", ("kill",), "EngineCoreDied", id="sigkill"
    ),
    pytest.param(
        f"worker:exit:rank=1:step={FAULT_STEP}:restart=0",
        ("--tensor-parallel-size", "2"),
        "WorkerDied",
        id="tp2-worker1-exit",
    ),
]


@pytest.mark.parametrize(("fault", "extra", "cause"), ROWS)
def test_every_stream_gets_what_it_would_have_got_without_the_failure(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
    reference: list[dict[str, Any]],
    tmp_path: Path,
    fault: str,
    extra: tuple[str, ...],
    cause: str,
) -> None:
    kill = extra == ("kill",)
    args = () if kill else extra
    dump_dir = tmp_path / "dumps"
    server, watch = start_server(*RESTART, "--crash-dump-dir", str(dump_dir), *args, fault=fault)
    first_core = _core(watch)

    if kill:
        crowd = _CrowdThread(server.base_url)
        _kill_core_when_hung(server, watch)
        results = crowd.join_results()
    else:
        results = run_crowd(server.base_url)

    assert reference == results, server.tail()
    assert server.returncode is None, server.tail()
    restarting = _events(server, "engine.restarting")
    assert [cause] == [r["cause"] for r in restarting], server.tail()
    assert 1 <= restarting[0]["num_requests"]  # the failure found requests in flight
    recovered = _events(server, "engine.recovered")
    assert 1 == len(recovered)
    assert 1 == _metric(server.base_url, f'otel_engine_engine_restarts_total{{cause="{cause}"')
    assert 1 <= _metric(server.base_url, "otel_engine_requests_migrated_total")
    assert 0 == _metric(server.base_url, "otel_engine_requests_poisoned_total")
    # The failure's one crash dump; the failed engine's processes are gone.
    files = sorted(dump_dir.glob("crash-*.json"))
    assert 1 == len(files), [f.name for f in files]
    assert 0 == json.loads(files[0].read_text())["system_stats"]["engine_restarts"]
    assert not is_alive(first_core)
    second_core = _core(watch)
    assert second_core.pid != first_core.pid
    # It serves on, and stops cleanly.
    assert reference[:1] == run_crowd(server.base_url, BODIES[:1])[:1]
    server.terminate()
    assert 0 == wait_exit(server), server.tail()
    watch.assert_all_gone()


@pytest.mark.parametrize(
    "kind",
    [pytest.param("raise", id="reported"), pytest.param("exit", id="silent-core-death")],
)
def test_a_poison_request_fails_alone_and_the_others_finish_as_without_it(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
    reference: list[dict[str, Any]],
    kind: str,
) -> None:
    """Its prompt makes the engine fail at every step that schedules it: the first failure
    makes the batch's requests without a token suspects, they go on trial one at a time,
    and each poison's trial is its second failure: it fails alone, uncharged to the budget."""
    poison = {"prompt": "poison " * 60, "temperature": 0}  # sent twice: streamed and not
    server, watch = start_server(
        *RESTART, "--max-engine-restarts", "2", fault=f"worker:{kind}:when=prompt_len>=50"
    )

    results = run_crowd(server.base_url, [*BODIES, poison])

    num = len(BODIES)
    streamed, full = results[: num + 1], results[num + 1 :]
    assert reference[:num] == streamed[:num], server.tail()
    assert reference[num:] == full[:num], server.tail()
    for failed in (streamed[num], full[num]):
        assert "engine_fault_request" == failed["error"]["code"], failed
    assert server.returncode is None, server.tail()
    assert 2 == _metric(server.base_url, "otel_engine_requests_poisoned_total")
    # Each poison failed the engine twice: at its first step (in the batch, or alone if it
    # came during a restart), then on trial. More failures than the budget of 2, yet
    # serving: those pinned on a poison were not charged.
    restarting = _events(server, "engine.restarting")
    assert 2 == sum(r["poison_request_id"] is not None for r in restarting), server.tail()
    assert len(restarting) > 2
    # Each poison's record names the failure it caused, as an engine death's names its cause.
    causes = {r["cause"] for r in restarting if r["poison_request_id"] is not None}
    poisoned = [r for r in _events(server, "request.failed") if r.get("cause_type") in causes]
    assert ["engine_fault_request"] * 2 == [r["error_type"] for r in poisoned], poisoned
    assert reference[:1] == run_crowd(server.base_url, BODIES[:1])[:1]  # still serving
    server.terminate()
    assert 0 == wait_exit(server), server.tail()
    watch.assert_all_gone()


def test_past_the_budget_the_server_shuts_down_as_without_restarts(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    server, watch = start_server(
        *RESTART, "--max-engine-restarts", "0", fault=f"engine_core:raise:step={FAULT_STEP}"
    )

    results = run_crowd(server.base_url)

    assert all(r["error"]["code"] == "engine_dead" for r in results), results
    assert 1 == wait_exit(server), server.tail()
    assert _events(server, "engine.restart_budget_exhausted")
    watch.assert_all_gone()


def test_an_engine_that_does_not_start_again_ends_the_server(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    server, watch = start_server(*RESTART, fault="engine_core:raise:phase=load:restart=1")

    os.kill(_core(watch).pid, signal.SIGKILL)

    assert 1 == wait_exit(server, timeout=60), server.tail()
    assert _events(server, "engine.restart_failed")
    watch.assert_all_gone()


def test_while_it_restarts_the_server_is_alive_not_ready_and_new_requests_wait(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    with OtlpReceiver("grpc") as receiver:
        server, watch = start_server(
            *RESTART,
            "--otlp-endpoint",
            receiver.endpoint,
            "--otlp-protocol",
            "grpc",
            fault=f"worker:hang:step={FAULT_STEP}:restart=0",
        )
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            crowd = _CrowdThread(server.base_url)
            deadline = time.monotonic() + 60
            while not _events(server, "fault.injected"):
                assert time.monotonic() < deadline, server.tail()
                time.sleep(0.05)
            os.kill(_core(watch).pid, signal.SIGKILL)
            seen: set[tuple[int, int, str | None]] = set()
            late: dict[str, Any] = {}
            while not _events(server, "engine.recovered"):
                assert time.monotonic() < deadline, server.tail()
                ready = client.get("/health")
                live = client.get("/health/live")
                seen.add((ready.status_code, live.status_code, ready.headers.get("retry-after")))
                if ready.status_code == 503 and not late:
                    late = client.post(
                        "/v1/completions", json=_body({"prompt": PROMPTS[0], "temperature": 0})
                    ).json()  # waits for the restart
                time.sleep(0.02)
            results = crowd.join_results()
            assert 200 == client.get("/health").status_code
        request_spans = receiver.wait_for(
            lambda r: [
                s
                for s in r.spans()
                if s["name"].startswith("text_completion ")
                and any(e["name"] == "otel_engine.request.engine_restarted" for e in s["events"])
            ],
            timeout=15,
        )
        crash_spans = [s for s in receiver.spans() if s["name"] == "engine_core.crash"]

    assert all("error" not in r for r in results), results
    assert late.get("choices"), late
    assert (503, 200, "5") in seen, seen
    assert 1 == len(crash_spans)
    crash = crash_spans[0]
    for span in request_spans:
        assert "ERROR" not in str(span["status"]["code"])
        links = {(link["trace_id"], link["span_id"]) for link in span["links"]}
        assert (crash["trace_id"], crash["span_id"]) in links
    server.terminate()
    assert 0 == wait_exit(server), server.tail()
    watch.assert_all_gone()


class _CrowdThread:
    """`run_crowd` in a thread of its own, while the test injects a fault."""

    def __init__(self, base_url: str) -> None:
        self._results: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()

    def _run(self, base_url: str) -> None:
        self._results = run_crowd(base_url)

    def join_results(self) -> list[dict[str, Any]]:
        self._thread.join(CLIENT_TIMEOUT_S)
        return self._results
