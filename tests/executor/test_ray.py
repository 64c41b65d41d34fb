"""Tensor parallel across machines on Ray: `--distributed-executor-backend ray` against Ray's
own multi-node test cluster on this machine (`ray.cluster_utils.Cluster`: a head and a worker
node, one CPU each, so TP=2 puts one rank on each node), all on the loopback address.

What must hold is the local executor's promise: the same greedy output; spans of the remote
ranks in the request's trace; a remote rank that raises, whose process is SIGKILLed, whose
node goes away, or that hangs ends every client with an error naming the rank and its node,
one crash dump (with where each rank ran), exit code 1 and nothing left in the Ray cluster;
a cluster that cannot hold the ranks is a one-line startup failure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.failures.crowd import PROMPT, run_crowd
from tests.helpers.isa import missing
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.procs import ServerProcess
from tests.helpers.ray_cluster import (
    LOOPBACK_ENV,
    placed,
    remove_worker_node_of,
    restore_nodes,
    serve_on,
    start_cluster,
    wait_nothing_left,
)

pytestmark = pytest.mark.slow

try:
    import ray
except ImportError:  # make install installs the ray extra: CI fails instead of skipping
    ray = None

PROMPTS = ["The engine core", "A worker on another node", "Tensor parallel ranks"]
FAULT_STEP = 30
DETECTION_S = 10.0  # the fault (or kill) to the last client's error
# a crowd's 8 x 500 tokens, where the default 1 GiB takes seconds to allocate on each rank
KV_BLOCKS = ("--num-kv-blocks", "512")
RESTART_TOKENS = 160  # a crowd's answers, long enough to be flowing when rank 1 is killed


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if ray is None:
        missing("Ray is not installed (pip install 'otel-engine[ray]'; make install does)")
    cluster = start_cluster()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def serve(
    model: str, cluster: Any, log: Path, *args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    return serve_on(cluster, model, log, *KV_BLOCKS, *args, env=env)


def startup_error(server: ServerProcess) -> str:
    """The one error line of a server that failed to start, once it exited 1."""
    try:
        code = server.wait(120)
    finally:
        server.cleanup()
    assert 1 == code, server.tail()
    (line,) = [line for line in server.lines() if line.startswith("otel-engine: error:")]
    return line


def greedy(base_url: str) -> list[str]:
    with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as client:
        texts = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert 200 == response.status_code, response.text
            texts.append(response.json()["choices"][0]["text"])
        return texts


def drill(server: ServerProcess, on_flowing: Any = None) -> list[Any]:
    """A crowd into the fault; every client failed with engine_dead; exit 1; one dump with
    the placement; nothing left in the cluster. Returns the client results."""
    server.wait_healthy(180)
    results = asyncio.run(run_crowd(server.base_url, 8, on_flowing=on_flowing))
    code = server.wait(60)
    for result in results:
        assert not result.hung, result
        assert result.error is not None, (result.status, result.body, result.events[-1:])
        assert "engine_dead" == result.error["code"], result.error
    assert 1 == code, server.tail()
    dumps = [r for r in server.json_lines() if r.get("event") == "engine_crash_dump"]
    assert 1 == len(dumps), f"{len(dumps)} dumps"
    dump = dumps[0]
    assert "ray" == dump["engine_config"]["distributed_executor_backend"]
    placement = dump["placement"]
    assert [0, 1] == [entry["rank"] for entry in placement]
    assert {"node_id", "node_ip", "hostname", "rank"} == set(placement[1])
    server.cleanup()
    wait_nothing_left()
    return results


def test_greedy_output_equals_the_local_executors_and_remote_spans_join_the_trace(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    flags = ["--model", tiny_model_dir, "--tensor-parallel-size", "2", "--dtype", "float32"]
    local = ServerProcess([*flags, *KV_BLOCKS], log_path=tmp_path / "local.log").start()
    try:
        local.wait_healthy(120)
        expected = greedy(local.base_url)
    finally:
        local.terminate()
        local.wait(60)
        local.cleanup()

    with OtlpReceiver("grpc") as receiver:
        server = serve(
            tiny_model_dir,
            cluster,
            tmp_path / "ray.log",
            "--otlp-endpoint",
            receiver.endpoint,
            env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        )
        try:
            server.wait_healthy(180)
            assert expected == greedy(server.base_url)
            ranks = placed(server)
            assert 2 == len({rank["node_id"] for rank in ranks}), "both ranks on one node"

            def remote_spans_in_step_traces(r: OtlpReceiver) -> list[dict[str, Any]]:
                spans = r.spans()
                steps = {s["trace_id"] for s in spans if s["name"] == "engine_core.step"}
                remote = [
                    s
                    for s in spans
                    if s["name"] == "worker.execute"
                    and s["attributes"].get("otel_engine.worker.rank") == 1
                ]
                return remote if remote and {s["trace_id"] for s in remote} <= steps else []

            spans = receiver.wait_for(remote_spans_in_step_traces, timeout=20)
            assert spans, "rank 1's spans did not reach the receiver in the steps' traces"
            assert "worker" == spans[0]["resource"].get("otel_engine.role", "worker")
            server.terminate()
            assert 0 == server.wait(60), server.tail()
        finally:
            server.cleanup()
    wait_nothing_left()


def test_a_remote_rank_that_raises(tiny_model_dir: str, cluster: Any, tmp_path: Path) -> None:
    server = serve(
        tiny_model_dir,
        cluster,
        tmp_path / "serve.log",
        env={"OTEL_ENGINE_FAULT": f"worker:raise:rank=1:step={FAULT_STEP}"},
    )
    results = drill(server)
    message = results[0].error["message"]
    assert "InjectedFault in otel-worker-1: rank 1 on 127.0.0.1 (node " in message, message


def test_a_remote_ranks_process_killed(tiny_model_dir: str, cluster: Any, tmp_path: Path) -> None:
    server = serve(tiny_model_dir, cluster, tmp_path / "serve.log")
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.time())
        os.kill(placed(server)[1]["pid"], signal.SIGKILL)

    results = drill(server, on_flowing=kill)
    message = results[0].error["message"]
    assert "WorkerDied in otel-worker-1: rank 1 on 127.0.0.1 (node " in message, message
    assert "its process died" in message, message
    assert max(r.ended_at for r in results) - killed[0] < DETECTION_S


def test_a_remote_ranks_node_removed(tiny_model_dir: str, cluster: Any, tmp_path: Path) -> None:
    """The worker node (not the head, which this test's driver needs) goes, with the rank on
    it."""
    server = serve(tiny_model_dir, cluster, tmp_path / "serve.log")
    removed: list[float] = []
    lost: list[int] = []

    def remove_node() -> None:
        removed.append(time.time())
        lost.append(remove_worker_node_of(cluster, server))

    try:
        results = drill(server, on_flowing=remove_node)
    finally:
        restore_nodes(cluster)
    message = results[0].error["message"]
    expected = f"WorkerDied in otel-worker-{lost[0]}: rank {lost[0]} on 127.0.0.1 (node "
    assert expected in message, message
    assert max(r.ended_at for r in results) - removed[0] < DETECTION_S


def test_a_remote_rank_that_hangs_is_named(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    server = serve(
        tiny_model_dir,
        cluster,
        tmp_path / "serve.log",
        "--step-timeout",
        "3",
        env={"OTEL_ENGINE_FAULT": f"worker:hang:rank=1:step={FAULT_STEP}"},
    )
    results = drill(server)
    message = results[0].error["message"]
    assert "StepTimeout" in message, message
    assert "rank 1 on 127.0.0.1 (node " in message, message
    assert "hung in maybe_inject" in message, message


def test_a_cluster_too_small_is_a_one_line_startup_failure(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    """Two ranks of two CPUs on two one-CPU nodes: refused at once, not waited on."""
    started = time.monotonic()
    server = serve(tiny_model_dir, cluster, tmp_path / "serve.log", "--ray-cpus-per-rank", "2")
    line = startup_error(server)
    assert time.monotonic() - started < 60
    assert "cannot place 2 ranks of {'CPU': 2.0} each (PACK): its 2 nodes hold 0" in line, line
    wait_nothing_left()


def test_no_cluster_to_join_is_a_one_line_startup_failure(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from tests.helpers.procs import free_port

    address = f"127.0.0.1:{free_port()}"
    flags = ["--model", tiny_model_dir, "--tensor-parallel-size", "2"]
    flags += ["--distributed-executor-backend", "ray", "--ray-address", address]
    flags += ["--engine-ready-timeout", "60"]
    server = ServerProcess(flags, env=LOOPBACK_ENV, log_path=tmp_path / "serve.log").start()
    line = startup_error(server)
    assert f"cannot join the Ray cluster at {address!r}" in line, line


def test_an_engine_core_killed_leaves_nothing_in_the_cluster(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    """SIGKILL of the engine core (the Ray driver): no shutdown runs, yet Ray removes its
    actors and its placement group with it, and the server exits 1."""
    from tests.failures.conftest import title

    server = serve(tiny_model_dir, cluster, tmp_path / "serve.log")
    try:
        server.wait_healthy(180)
        (core,) = [p for p in server.descendants() if title(p) == "otel-engine-core"]
        core.kill()
        assert 1 == server.wait(60), server.tail()
    finally:
        server.cleanup()
    wait_nothing_left(timeout=60)


def test_which_clusters_hold_the_ranks_by_strategy() -> None:
    """Two one-CPU nodes hold two one-CPU ranks, except on one node (STRICT_PACK)."""
    from otel_engine.executor.ray_executor import bundles_held

    nodes = [{"CPU": 1.0}, {"CPU": 1.0}, {"GPU": 1.0}]
    cpu = {"CPU": 1.0}
    assert [2, 2, 2, 1] == [
        bundles_held(nodes, cpu, s) for s in ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
    ]
    assert 0 == bundles_held(nodes, {"CPU": 1.0, "GPU": 1.0}, "PACK")
    assert 3 == bundles_held([{"CPU": 3.5}], cpu, "STRICT_PACK")


def test_a_strict_pack_no_node_holds_is_refused_at_once(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    server = serve(
        tiny_model_dir, cluster, tmp_path / "serve.log", "--ray-placement-strategy", "STRICT_PACK"
    )
    line = startup_error(server)
    assert "cannot place 2 ranks of {'CPU': 1.0} each (STRICT_PACK): its 2 nodes hold 1" in line
    wait_nothing_left()


def test_a_placement_group_that_waits_past_the_ready_timeout_is_one_line(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    """The cluster could hold the ranks, but another engine has taken its CPUs: the second
    one waits for its placement group until --engine-ready-timeout, then says why."""
    first = serve(tiny_model_dir, cluster, tmp_path / "first.log")
    try:
        first.wait_healthy(180)
        second = serve(
            tiny_model_dir, cluster, tmp_path / "second.log", "--engine-ready-timeout", "8"
        )
        line = startup_error(second)
        assert "placement group of 2 ranks" in line, line
        assert "was not placed within --engine-ready-timeout (8 s)" in line, line
    finally:
        first.terminate()
        first.wait(60)
        first.cleanup()
    wait_nothing_left()


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_engine.errors import EngineStartupError
    from otel_engine.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(EngineStartupError, match=r"pip install 'otel-engine\[ray\]'"):
        import_ray()


@pytest.mark.parametrize(
    ("fault", "args", "expected"),
    [
        # raises while loading, as a model path missing on its node would
        ("raise", (), ["otel-worker-1 on 127.0.0.1 (node ", "failed to start: InjectedFault"]),
        # its process exits while loading, as an OOM kill would end it
        ("exit", (), ["otel-worker-1 died while starting: its process died"]),
        # hangs while loading: given up at the ready timeout, not waited on forever
        (
            "hang",
            ("--engine-ready-timeout", "10"),
            ["otel-worker-1 did not start within --engine-ready-timeout (10 s)"],
        ),
    ],
)
def test_a_rank_that_fails_to_start_is_one_line_naming_it(
    fault: str,
    args: tuple[str, ...],
    expected: list[str],
    tiny_model_dir: str,
    cluster: Any,
    tmp_path: Path,
) -> None:
    server = serve(
        tiny_model_dir,
        cluster,
        tmp_path / "serve.log",
        *args,
        env={"OTEL_ENGINE_FAULT": f"worker:{fault}:rank=1:phase=load"},
    )
    line = startup_error(server)
    for part in expected:
        assert part in line, line
    wait_nothing_left()


def test_a_program_with_its_own_ray_session_keeps_it(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    """The engine in this process (the offline `LLM`), in a program that has called
    `ray.init` itself (this test's cluster fixture did): the engine joins that session, gives
    the same greedy output as the local executor, and at shutdown removes its actors and
    placement group but leaves the program's session open."""
    from otel_engine import LLM, SamplingParams

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(max_tokens=8, temperature=0)
    options: dict[str, Any] = {"tensor_parallel_size": 2, "dtype": "float32", "num_kv_blocks": 64}
    local = LLM(tiny_model_dir, **options)
    try:
        expected = [o.outputs[0].token_ids for o in local.generate(prompts, params)]
    finally:
        local.shutdown()

    session = ray.get_runtime_context().get_job_id()
    llm = LLM(
        tiny_model_dir,
        distributed_executor_backend="ray",
        ray_address=cluster.address,
        engine_ready_timeout=120,
        **options,
    )
    try:
        assert expected == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert ray.is_initialized()
    assert session == ray.get_runtime_context().get_job_id()
    wait_nothing_left()


def test_a_ray_address_other_than_the_programs_session_is_refused(
    tiny_model_dir: str, cluster: Any
) -> None:
    from otel_engine import LLM
    from otel_engine.errors import EngineStartupError
    from tests.helpers.procs import free_port

    other = f"127.0.0.1:{free_port()}"
    with pytest.raises(EngineStartupError, match="names another cluster than the one this"):
        LLM(
            tiny_model_dir,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray_address=other,
        )
    assert ray.is_initialized()
    wait_nothing_left()


def test_a_ranks_death_is_told_by_rays_exception_type() -> None:
    """Ray's exception types and the node's state say how a rank went, not Ray's wording."""
    if ray is None:
        missing("Ray is not installed (pip install 'otel-engine[ray]'; make install does)")
    from otel_engine.executor.ray_executor import death_reason

    errors = ray.exceptions
    died = errors.ActorDiedError()
    assert "its process died" == death_reason(died, errors, node_alive=True)
    assert "its process died" == death_reason(died, errors, node_alive=None)
    assert "its node died" == death_reason(died, errors, node_alive=False)
    assert "its node died" == death_reason(errors.NodeDiedError("gone"), errors, None)
    unavailable = errors.ActorUnavailableError("no answer", None)
    assert death_reason(unavailable, errors, True).startswith("it is unreachable")
    assert "out of memory" in death_reason(errors.OutOfMemoryError("m"), errors, True)
    assert "its process died" == death_reason(errors.WorkerCrashedError(), errors, True)
    assert "RuntimeError" == death_reason(RuntimeError("x"), errors, True)


def test_which_ray_addresses_name_the_joined_cluster() -> None:
    from otel_engine.executor.ray_executor import same_cluster

    assert same_cluster("127.0.0.1:6379", "127.0.0.1:6379")
    assert same_cluster("localhost:6379", "127.0.0.1:6379")
    assert not same_cluster("127.0.0.1:6380", "127.0.0.1:6379")
    assert same_cluster("auto", "10.0.0.7:6379")
    assert same_cluster("ray://head:10001", "10.0.0.7:6379")


def test_a_remote_ranks_process_killed_under_restart_is_a_pause(
    tiny_model_dir: str, cluster: Any, tmp_path: Path
) -> None:
    """`--on-engine-failure restart` on Ray: rank 1's process SIGKILLed while a crowd of
    greedy requests runs; the engine core places new ranks, every client gets the whole
    answer (each the same text as the same request sent after the restart), the failure
    leaves its one dump, and nothing of either engine stays in the cluster at exit."""
    restart = ("--on-engine-failure", "restart")
    server = serve(tiny_model_dir, cluster, tmp_path / "serve.log", *restart)
    try:
        server.wait_healthy(180)

        def kill() -> None:
            os.kill(placed(server)[1]["pid"], signal.SIGKILL)

        results = asyncio.run(
            run_crowd(server.base_url, 6, max_tokens=RESTART_TOKENS, on_flowing=kill)
        )
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            body = {"prompt": PROMPT, "max_tokens": RESTART_TOKENS, "temperature": 0}
            response = client.post("/v1/completions", json={**body, "ignore_eos": True})
        expected = response.json()["choices"][0]["text"]
        for result in results:
            assert result.error is None, result.error
            assert result.completed, (result.status, result.events[-1:])
            assert expected == _text(result)
        events = [r.get("event") for r in server.json_lines()]
        assert 2 == events.count("ray.ranks_placed")
        assert 1 == events.count("engine_crash_dump")
        assert 1 == events.count("engine.recovered")
        server.terminate()
        assert 0 == server.wait(60), server.tail()
    finally:
        server.cleanup()
    wait_nothing_left(timeout=60)


def _text(result: Any) -> str:
    if not result.is_stream:
        return str(result.body["choices"][0]["text"])
    return "".join(
        str(event["choices"][0].get("text") or "")
        for event in result.events
        if isinstance(event, dict) and event.get("choices")
    )
