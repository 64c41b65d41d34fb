"""otel-engine replicas behind a real router: vLLM's `vllm-router` (the Rust router of its
PyPI wheel) in front of three servers of the tiny model, all on 127.0.0.1.

What an operator of a fleet relies on: the official client works through the router, streams
and not; the client's trace reaches each replica's request span; `cache_aware` routing keeps
an agent's system prompt on one replica (a higher prefix-cache hit rate than `round_robin`, read
from the replicas' own counters); and when one replica's engine core is SIGKILLed under 48
streams, only that replica's streams fail, each with its error event, the router stops
sending it requests, every other stream completes and the dead replica exits 1 with its one
crash dump, as on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.fleet import (
    Fleet,
    replica_death_drill,
    routed_hit_rate,
    router_binary,
    shared_prefix_chats,
)
from tests.helpers.isa import missing
from tests.helpers.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow

NUM_STREAMS = 48
# Bounds of the drill (measured 0.1 s, 0.1 s and 0.3 s on a 2-core machine: bench/fleet.py)
LAST_FAILURE_S = 5.0  # kill to the last failed client's error event
UNHEALTHY_S = 3.0  # kill to the router marking the replica unhealthy (1 s health checks)
EXIT_S = 10.0  # kill to the dead replica's exit


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver("grpc") as receiver:
        yield receiver


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: str, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    if router_binary() is None:
        missing("vllm-router is not installed (pip install vllm-router; the test extras do)")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        **receiver.env(),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with Fleet(
        tiny_model_dir, policy="power_of_two", env=env, log_dir=tmp_path_factory.mktemp("fleet")
    ) as fleet:
        yield fleet


def test_the_official_client_through_the_router_and_its_trace(
    fleet: Fleet, receiver: OtlpReceiver
) -> None:
    """Streams and not, chat and completions: each answers through the router, and each
    replica's request span is a child of the client's span (the router forwards
    `traceparent` as it came)."""
    import openai

    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    parents: dict[str, str] = {}
    for index in range(8):
        trace_id, span_id = f"{index + 1:032x}", f"{index + 1:016x}"
        parents[trace_id] = span_id
        headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
        messages = [{"role": "user", "content": f"hello {index}"}]
        if index % 4 == 0:
            chat = client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, extra_headers=headers
            )
            assert chat.choices[0].finish_reason == "length"
        elif index % 4 == 1:
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, stream=True, extra_headers=headers
            )
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
        elif index % 4 == 2:
            completion = client.completions.create(
                model=model, prompt="hello", max_tokens=5, extra_headers=headers
            )
            assert completion.choices[0].finish_reason == "length"
        else:
            pieces = list(
                client.completions.create(
                    model=model, prompt="hello", max_tokens=5, stream=True, extra_headers=headers
                )
            )
            assert pieces[-1].choices[0].finish_reason == "length"

    def request_spans(r: OtlpReceiver) -> list[dict]:
        found = [s for s in r.spans() if s["trace_id"] in parents and s["kind"] == "SERVER"]
        return found if len({s["trace_id"] for s in found}) == len(parents) else []

    spans = receiver.wait_for(request_spans, timeout=20)
    assert spans, "not every request's span reached the receiver"
    for span in spans:
        assert parents[span["trace_id"]] == span["parent_span_id"], span["name"]
    instances = {s["resource"].get("service.instance.id") for s in spans}
    assert len(instances) >= 2, f"power_of_two sent 8 requests to {instances}"


def test_cache_aware_routing_keeps_each_system_prompt_on_one_replica(fleet: Fleet) -> None:
    """Six agents, each with its own system prompt, six requests each in a shuffled order:
    `cache_aware` sends an agent's requests to the replica that holds its prefix, so more
    prompt tokens hit the cache than when `round_robin` spreads them."""
    model = fleet.model
    rates = {
        policy: routed_hit_rate(fleet, policy, shared_prefix_chats(model, seed=seed))
        for seed, policy in enumerate(("round_robin", "cache_aware"))
    }
    # measured 0.50 and 0.75 (the most six agents on three replicas allow: one miss each)
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


def test_a_replica_dies_under_load(tiny_model_dir: str, tmp_path: Path) -> None:
    """48 streams over three replicas; one replica's engine core is SIGKILLed once every
    stream has its first token."""
    if router_binary() is None:
        missing("vllm-router is not installed (pip install vllm-router; the test extras do)")
    with Fleet(tiny_model_dir, policy="power_of_two", log_dir=tmp_path) as fleet:
        drill = replica_death_drill(fleet, victim=0, num_streams=NUM_STREAMS)
        victim = fleet.replicas[0]
        for survivor in fleet.replicas[1:]:
            survivor.wait_healthy(timeout=5)
        log = victim.json_lines()

    # only the victim's streams failed, each with its error event (none hung, none cut)
    assert 0 < drill.in_flight_on_victim < NUM_STREAMS
    assert len(drill.failed) == drill.in_flight_on_victim
    assert len(drill.completed) == NUM_STREAMS - drill.in_flight_on_victim
    for result in drill.failed:
        assert not result.hung, result
        assert result.transport_error is None, result
        assert 200 == result.status
        assert result.error is not None, result.events
        assert "engine_dead" == result.error["code"], result.error
        assert "EngineCoreDied" in result.error["message"]
        assert "[DONE]" not in result.events
    for result in drill.completed:
        assert result.error is None
        assert "[DONE]" == result.events[-1]
    assert drill.last_failure_s is not None
    assert drill.last_failure_s < LAST_FAILURE_S

    # the router stopped sending it requests; every new request succeeded meanwhile
    assert drill.unhealthy_after_s is not None
    assert drill.unhealthy_after_s < UNHEALTHY_S
    assert drill.last_routed_to_victim_s < UNHEALTHY_S
    assert drill.probes
    assert [p for p in drill.probes if not p.ok] == []

    # the dead replica ended as on one machine: exit code 1, one crash dump
    assert 1 == drill.exit_code, victim.tail()
    assert drill.victim_exited_at is not None
    assert drill.victim_exited_at - drill.killed_at < EXIT_S
    assert 1 == len([record for record in log if record.get("event") == "engine_crash_dump"])
