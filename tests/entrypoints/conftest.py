"""Fixtures for the HTTP API tests: real engines, real uvicorn servers in a background loop.

Every server of this package runs in one background thread's event loop (`ServerLoop`),
because an `AsyncLLM` is bound to the event loop of its first request. Clients (`openai`,
`httpx`) talk to them over real TCP sockets from the test thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from otel_engine.entrypoints.network.server import ApiServer, bind_socket
from tests.helpers.scrape import metric_value

API_KEY = "test-key-123"


class ServerLoop:
    """One event loop in a daemon thread that runs any number of `ApiServer`s."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="test-servers", daemon=True
        )
        self._thread.start()
        self._running: list[tuple[ApiServer, Future[None]]] = []

    def start(self, server: ApiServer) -> str:
        """Serve on a fresh port of 127.0.0.1 and return the base URL once listening."""
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self._running.append((server, future))
        deadline = time.monotonic() + 30
        while not server.started:
            if future.done():
                future.result()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def wait(self, server: ApiServer, timeout: float = 30.0) -> None:
        """Wait until `server` has stopped serving by itself."""
        for running, future in self._running:
            if running is server:
                future.result(timeout)

    def stop(self, server: ApiServer, timeout: float = 30.0) -> None:
        server.should_exit = True
        self.wait(server, timeout)

    def close(self) -> None:
        for server, future in self._running:
            server.should_exit = True
            future.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Served:
    """A running server: its base URL, its engine and the server object."""

    base_url: str
    engine: AsyncLLM
    server: ApiServer

    @property
    def model(self) -> str:
        return self.engine.model_name

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=kwargs.pop("api_key", "x"),
            max_retries=0,
            timeout=kwargs.pop("timeout", 60),
            **kwargs,
        )

    def async_openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, timeout=120, **kwargs
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, trust_env=False)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of GET /metrics (0 when absent)."""
        return metric_value(self.base_url, name, **labels)


@pytest.fixture(scope="package")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="package")
def engine(tiny_model_dir: str) -> Iterator[AsyncLLM]:
    """The tiny model in a real multiprocess engine (engine core in its own process)."""
    llm = AsyncLLM(model=tiny_model_dir, max_num_seqs=64, num_kv_blocks=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="package")
def served(server_loop: ServerLoop, engine: AsyncLLM) -> Served:
    """An open server (no API key) over the shared engine."""
    server = make_server(engine, drain_timeout=5)
    return Served(server_loop.start(server), engine, server)


@pytest.fixture(scope="package")
def keyed(server_loop: ServerLoop, engine: AsyncLLM) -> Served:
    """A second server over the same engine that requires `API_KEY`."""
    server = make_server(engine, api_key=API_KEY, drain_timeout=5)
    return Served(server_loop.start(server), engine, server)


@contextmanager
def serving_model(
    loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, kind: str
) -> Iterator[Served]:
    """A server over `kind`: `hermes` (the tiny model with Qwen2.5's tool markup) or
    `generic` (the default model, SmolLM2, whose template has no tool format)."""
    from tests.helpers.tiny_model import write_tiny_tool_model

    model = (
        write_tiny_tool_model(tmp_path_factory.mktemp("tool-model")) if kind == "hermes" else None
    )
    engine = AsyncLLM(model=model, max_num_seqs=8)
    server = make_server(engine, drain_timeout=5)
    try:
        yield Served(loop.start(server), engine, server)
        loop.stop(server)
    finally:
        engine.shutdown()
