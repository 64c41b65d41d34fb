"""docs/architecture.md's "The HTTP edge" says what the code is: its rooms and module bound
are the layout test's, the modules it names exist, and its numbered walk of a chat request is
what a real request does.

The walk is recorded with `sys.setprofile` on the server's event loop and `threading.setprofile`
for its tokenizer thread: every call into the package whose outermost package frame is the
edge's (the request's own path; the server's tick and the engine's output loop are not), with
the package modules below it on the stack. The edge modules the request enters, in the order
it first enters them, are the doc's steps; and no module of the edge is entered again from
below itself (a call out to another module and back in) but through a function it handed
down (a closure: the ASGI `send` and `receive` wrappers)."""

from __future__ import annotations

import ast
import asyncio
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from otel_engine.entrypoints.network.guard import ServerState
from tests.entrypoints.conftest import ServerLoop
from tests.helpers.paths import REPO_ROOT
from tests.test_layout import MAX_EDGE_MODULE_LINES, PACKAGE, ROOMS

DOC = REPO_ROOT / "docs" / "architecture.md"
SECTION = "## The HTTP edge"
EDGE_PREFIX = "entrypoints/"
# The server's own loop (startup, ticks) is not a request's path.
NOT_A_REQUEST = "entrypoints/network/server.py"
STEP = re.compile(
    r"^\d+\. `(?P<module>[\w/]+\.py)` → `(?P<name>[\w.]+)`"
    r"(?: \(streamed:\s+`(?P<streamed>[\w.]+)`\))?:",
    re.MULTILINE,
)
EDGE_REF = re.compile(r"`(?:otel_engine/)?(entrypoints/[\w/.]+)`")
_PACKAGE_PREFIX = f"{PACKAGE}/"


@dataclass(frozen=True, slots=True)
class Step:
    """One numbered step of the doc's walk: a module and the function it names."""

    module: str  # under otel_engine/
    name: str
    streamed: str | None  # the function a streamed request reaches instead

    def function(self, stream: bool) -> str:
        return self.streamed if stream and self.streamed else self.name


@dataclass(frozen=True, slots=True)
class Call:
    """One call into the package: the callee, and the modules on the stack below it
    (outermost first, a module's consecutive frames as one)."""

    module: str
    function: str  # the callee's qualified name
    below: tuple[str, ...]

    @property
    def is_request_path(self) -> bool:
        root = self.below[0] if self.below else self.module
        return root.startswith(EDGE_PREFIX) and root != NOT_A_REQUEST


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def _steps() -> list[Step]:
    return [Step(m["module"], m["name"], m["streamed"]) for m in STEP.finditer(_section())]


def _names(qualname: str, name: str) -> bool:
    """`name` (as the doc writes it) names the function `qualname`: the same, a method of
    the class it names, or a function nested in another (a route)."""
    return qualname == name or qualname.startswith(f"{name}.") or qualname.endswith(f".{name}")


def _qualnames(path: Path) -> set[str]:
    """The qualified names of every class and function defined in `path`."""
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def _module(code: CodeType) -> str | None:
    name = code.co_filename
    return name.removeprefix(_PACKAGE_PREFIX) if name.startswith(_PACKAGE_PREFIX) else None


class Recorder:
    """A profile function: records each call into the package while `is_on`."""

    def __init__(self) -> None:
        self.is_on = False
        self.calls: list[Call] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.is_on:
            return
        module = _module(frame.f_code)
        if module is None:
            return
        below: list[str] = []
        caller = frame.f_back
        while caller is not None:
            name = _module(caller.f_code)
            if name is not None and (not below or below[-1] != name):
                below.append(name)
            caller = caller.f_back
        self.calls.append(Call(module, frame.f_code.co_qualname, tuple(reversed(below))))


def _walk(calls: list[Call], steps: list[Step]) -> list[str]:
    """The edge modules the request entered, and the modules of the doc's other steps once
    their function was called, in the order first reached."""
    order: list[str] = []
    others = {step.module: step.name for step in steps if not step.module.startswith(EDGE_PREFIX)}
    for call in calls:
        is_step = call.module in others and _names(call.function, others[call.module])
        if (call.module.startswith(EDGE_PREFIX) or is_step) and call.module not in order:
            order.append(call.module)
    return order


def _reentries(calls: list[Call]) -> set[tuple[str, str, tuple[str, ...]]]:
    """Calls into an edge module already on the stack below another module, but through a
    function it handed down (a closure)."""
    found = set()
    for call in calls:
        if not call.module.startswith(EDGE_PREFIX) or "<locals>" in call.function:
            continue
        if call.below and call.below[-1] != call.module and call.module in call.below:
            found.add((call.module, call.function, call.below))
    return found


# Loop turns that end what a request left scheduled once it left the guard (a watch's
# cancelled waits, the middlewares' unwinding), so none of it runs under the next recording.
SETTLE_TURNS = 20


def _wait_until_idle(state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
    """Until no request is in flight and the loop has run what the last one left behind."""
    deadline = time.monotonic() + 10.0
    while state.num_in_flight:
        assert time.monotonic() < deadline, "the request did not end"
        time.sleep(0.01)

    async def settle() -> None:
        for _ in range(SETTLE_TURNS):
            await asyncio.sleep(0)

    asyncio.run_coroutine_threadsafe(settle(), loop).result(10)


@pytest.fixture(scope="module")
def walks(tiny_model_dir: str) -> Iterator[dict[bool, list[Call]]]:
    """The request path of one chat request, whole (False) and streamed (True), on a server
    of its own (so that its tokenizer thread starts under the recorder), on an event loop
    and engine of its own: the package's loop also runs the other tests' servers, and what
    their requests left running would be recorded with this one."""
    import httpx

    server_loop = ServerLoop()
    engine = AsyncLLM(model=tiny_model_dir, max_num_seqs=4, num_kv_blocks=64)
    recorder = Recorder()
    threading.setprofile(recorder)
    server = make_server(engine, drain_timeout=5)

    async def profile_loop(function: Recorder | None) -> None:
        sys.setprofile(function)

    try:
        base_url = server_loop.start(server)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        walks: dict[bool, list[Call]] = {}
        asyncio.run_coroutine_threadsafe(profile_loop(recorder), server_loop.loop).result(10)
        with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as client:
            client.post("/v1/chat/completions", json=body).raise_for_status()  # lazy set-up
            for stream in (False, True):
                # The client has its bytes before the server has unwound the last request.
                _wait_until_idle(server.state, server_loop.loop)
                recorder.calls = []
                recorder.is_on = True
                answer = client.post("/v1/chat/completions", json={**body, "stream": stream})
                _wait_until_idle(server.state, server_loop.loop)
                recorder.is_on = False
                answer.raise_for_status()
                walks[stream] = [call for call in recorder.calls if call.is_request_path]
        yield walks
    finally:
        recorder.is_on = False
        threading.setprofile(None)
        asyncio.run_coroutine_threadsafe(profile_loop(None), server_loop.loop).result(10)
        try:
            server_loop.close()
        finally:
            engine.shutdown()


def test_the_doc_names_the_rooms_and_the_bound_of_the_layout() -> None:
    """The section's rooms are the layout test's rooms, and its line bound its bound."""
    section = _section()
    rooms = re.findall(r"^- \*\*(\w+)\*\* \(`entrypoints/(\w+)/`\)", section, re.MULTILINE)

    assert [(room, room) for room in ROOMS] == rooms
    assert f"no module over {MAX_EDGE_MODULE_LINES} lines" in section


def test_every_edge_module_the_docs_name_exists() -> None:
    """Each `entrypoints/...` folder, module or `module.Name` that docs/ name is there (with
    that name defined in the module)."""
    missing = []
    for doc in sorted((REPO_ROOT / "docs").glob("*.md")):
        for ref in EDGE_REF.findall(doc.read_text(encoding="utf-8")):
            if ref.endswith(("/", ".py")):
                is_there = (PACKAGE / ref).exists()
            else:
                module, _, name = ref.rpartition(".")
                path = PACKAGE / f"{module}.py"
                is_there = path.exists() and name in _qualnames(path)
            if not is_there:
                missing.append(f"{doc.name}: {ref}")

    assert [] == missing


def test_each_step_of_the_walk_names_a_function_of_its_module() -> None:
    """The walk has a step per module, each naming a class or function defined there."""
    steps = _steps()
    unknown = [
        (step.module, name)
        for step in steps
        for name in filter(None, (step.name, step.streamed))
        if not any(_names(q, name) for q in _qualnames(PACKAGE / step.module))
    ]

    assert steps, "no numbered walk under " + SECTION
    assert len({step.module for step in steps}) == len(steps)
    assert [] == unknown


@pytest.mark.slow  # starts a server on the package's engine
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_request_enters_the_modules_in_the_docs_order(
    walks: dict[bool, list[Call]], stream: bool
) -> None:
    """The modules a real chat request enters, in order, are the doc's steps."""
    steps = _steps()

    assert [step.module for step in steps] == _walk(walks[stream], steps)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_request_calls_each_steps_function(
    walks: dict[bool, list[Call]], stream: bool
) -> None:
    """Each step's function (the streamed one for a stream) runs on the request's path, and
    so does the connection's `on_response_complete` the doc ends with."""
    steps = [(step.module, step.function(stream)) for step in _steps()]
    steps.append(("entrypoints/network/connections.py", "GuardedH11Protocol.on_response_complete"))
    called = {(call.module, call.function) for call in walks[stream]}

    assert [] == [
        (module, name)
        for module, name in steps
        if not any(m == module and _names(q, name) for m, q in called)
    ]
    assert "`GuardedH11Protocol.on_response_complete`" in _section()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_no_module_of_the_edge_is_entered_again_from_below(
    walks: dict[bool, list[Call]], stream: bool
) -> None:
    """A call out to another module never comes back into the caller's module but through
    a function the caller handed down."""
    assert set() == _reentries(walks[stream])


def test_the_reentry_check_finds_a_call_back_into_a_module() -> None:
    """The check itself: a module-level function of a module already below is found, its
    closures and its own calls are not."""
    streaming, rendering = "entrypoints/network/streaming.py", "entrypoints/openai/rendering.py"
    calls = [
        Call(streaming, "sse_event", (streaming, rendering)),
        Call(streaming, "_replay.<locals>.replayed", (streaming, rendering)),
        Call(streaming, "RequestWatch.close", (rendering, streaming)),
    ]

    assert {(streaming, "sse_event", (streaming, rendering))} == _reentries(calls)
