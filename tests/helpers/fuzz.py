"""Schemathesis against a running server's own OpenAPI document: no 5xx, and every answer
(status, content type, headers, body) as the document says; and a hypothesis search for 5xx
over the values the document cannot describe (`search_server_errors`): hand-written hostile
requests (`request_cases`), earlier tool calls and Responses items a client gets wrong
(`history_cases`), and bodies drawn from the document's request schemas with a hostile value
put somewhere inside (`schema_cases`)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from typing import Any

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)


def run_schemathesis(
    base_url: str,
    *,
    max_examples: int,
    seed: int,
    phases: str = "examples,coverage,fuzzing",
    max_time_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`st run` in a subprocess (one worker, seeded); returns its result with the report."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        phases,
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    if max_time_s is not None:
        command += ["--max-time", str(int(max_time_s))]
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)


# ---- A hypothesis search for 5xx over what the OpenAPI document cannot describe -----------
# Schemathesis draws bodies from the document, where `logit_bias` is any map of strings to
# numbers and `response_format` any object; the values that broke the server were deeper
# (a 5,000-digit token id, a schema that is a `$ref` to itself), so they are drawn here.


def _schemas() -> Any:
    from hypothesis import strategies as st

    leaves = st.one_of(
        st.sampled_from(
            [
                {},
                {"type": "string"},
                {"type": "integer", "minimum": 3, "maximum": 1},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"type": "object"},
                {"type": "array"},
                {"enum": []},
                {"enum": [1, "a", None]},
                {"const": "x"},
                {"$ref": "#"},
                {"$ref": "#/$defs/missing"},
                {"$ref": "http://example.com/s"},
                {"type": "string", "pattern": "["},
                {"type": "string", "pattern": "^(ab)*$"},
                {"type": "string", "format": "date-time"},
                {"type": "nonsense"},
                {"not": {}},
            ]
        ),
    )
    keys = st.text(min_size=0, max_size=4)

    def nested(children: Any) -> Any:
        return st.one_of(
            st.builds(
                lambda props, required: {
                    "type": "object",
                    "properties": props,
                    "required": required,
                },
                st.dictionaries(keys, children, max_size=3),
                st.lists(keys, max_size=2),
            ),
            st.builds(lambda items: {"type": "array", "items": items}, children),
            st.builds(lambda options: {"anyOf": options}, st.lists(children, max_size=3)),
            st.builds(lambda options: {"allOf": options}, st.lists(children, max_size=2)),
            st.builds(
                lambda a, b, ref: {"$defs": {"a": a, "b": b}, "$ref": ref},
                children,
                st.one_of(children, st.just({"$ref": "#/$defs/a"})),
                st.sampled_from(["#/$defs/a", "#/$defs/b", "#", "#/$defs"]),
            ),
        )

    return st.recursive(leaves, nested, max_leaves=8)


def request_cases() -> Any:
    """(path, body) pairs of completions and chat completions with hostile `logit_bias`,
    `response_format` and numbers; generation stays a few tokens long."""
    from hypothesis import strategies as st

    token_ids = st.one_of(
        st.integers(-5, 10**30).map(str),
        st.integers(1, 6000).map(lambda digits: "7" * digits),
        st.text(max_size=6),
    )
    biases = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**6), 10**6))
    response_formats = st.one_of(
        st.none(),
        st.just({"type": "json_object"}),
        st.builds(
            lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            _schemas(),
        ),
        st.dictionaries(
            st.sampled_from(["type", "json_schema", "schema"]),
            st.one_of(st.text(max_size=8), st.integers(), st.none()),
            max_size=2,
        ),
    )
    numbers = st.sampled_from([1, 2, 4, 0, -1, 2.0, 2.5, 10**30, 1e300, -1e300, "4"])
    fields = st.fixed_dictionaries(
        {},
        optional={
            "logit_bias": st.dictionaries(token_ids, biases, max_size=4),
            "response_format": response_formats,
            "max_tokens": numbers,
            "top_k": numbers,
            "seed": numbers,
            "min_tokens": numbers,
        },
    )
    chat = fields.map(
        lambda f: (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **f},
        )
    )
    completion = fields.map(lambda f: ("/v1/completions", {"prompt": "hi", "max_tokens": 4, **f}))
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    choices = st.sampled_from(
        [
            "auto",
            "none",
            "required",
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "zz"}},
            {"type": "function", "name": "f"},
            5,
            "bogus",
        ]
    )
    tool_lists = st.sampled_from(
        [[tool], [tool, tool], [], [{"type": "function", "function": {"name": ""}}], [{"x": 1}]]
    )
    tool_fields = st.fixed_dictionaries(
        {},
        optional={
            "tools": tool_lists,
            "tool_choice": choices,
            "parallel_tool_calls": st.sampled_from([True, False, "x"]),
            "response_format": response_formats,
            "max_tokens": numbers,
        },
    )
    tool_chat = tool_fields.map(
        lambda f: (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **f},
        )
    )
    inputs = st.sampled_from(
        [
            "hi",
            [{"role": "user", "content": "hi"}],
            [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
            [{"type": "function_call_output", "call_id": "c", "output": "x"}],
            [{"type": "function_call", "call_id": 3}],
            [{"type": "bogus"}],
            [{"role": "robot", "content": "hi"}],
            [],
            3,
        ]
    )
    responses = st.fixed_dictionaries(
        {"input": inputs},
        optional={
            "max_output_tokens": numbers,
            "tools": st.sampled_from([[{"type": "function", **tool["function"]}], [{"type": "x"}]]),
            "tool_choice": choices,
            "instructions": st.sampled_from(["Be brief.", 3, ""]),
            "text": st.sampled_from(
                [{"format": {"type": "json_object"}}, {"format": {"type": "bogus"}}, 1]
            ),
            "previous_response_id": st.sampled_from(["resp_1", 3]),
        },
    ).map(lambda body: ("/v1/responses", {"max_output_tokens": 4, **body}))
    return st.one_of(chat, completion, tool_chat, responses)


# ---- Round three: earlier tool calls, Responses items, and any value anywhere ---------------


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def hostile_values() -> Any:
    """JSON values a client should not send: nested around the depth limit and far past it,
    lone surrogates (as key and as value), huge numbers, NaN and infinities, wrong types."""
    from hypothesis import strategies as st

    return st.one_of(
        st.sampled_from([1, 63, 64, 65, 200, 500]).map(_nested),
        st.sampled_from(["\ud800", "a\udfffb", "\udc00x"]).map(
            lambda escaped: json.loads(f'"{escaped}"')
        ),
        st.just({json.loads('"\ud800"'): 1}),
        st.sampled_from(
            [10**4000, -(10**400), 1e308, float("nan"), float("-inf"), 0, -1, True, None, "", []]
        ),
        st.text(max_size=8),
    )


def _arguments_texts() -> Any:
    """The `arguments` text of an earlier call: JSON, not JSON, nested past every bound
    (balanced or not), lone surrogates escaped in it."""
    from hypothesis import strategies as st

    return st.one_of(
        st.sampled_from(
            [
                "{}",
                '{"city": "Oslo"}',
                "not json",
                "",
                '"\\ud800"',
                '{"a": "\\udc00"}',
                '{"\\ud800": 1}',
                "[" * 1200,
                "[" * 900 + "]" * 900,
                '{"a": ' * 70 + "1" + "}" * 70,
                "1" * 5000,
                "NaN",
            ]
        ),
        st.recursive(
            st.one_of(st.integers(), st.text(max_size=4), st.none()),
            lambda children: st.one_of(
                st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children)
            ),
            max_leaves=6,
        ).map(json.dumps),
        st.text(max_size=12),
    )


def history_cases() -> Any:
    """(path, body) pairs of chats, /tokenize and Responses whose earlier tool calls or input
    items a client got wrong."""
    from hypothesis import strategies as st

    arguments = _arguments_texts()
    texts = st.one_of(st.text(max_size=6), hostile_values())
    calls = st.builds(
        lambda call_id, name, args: {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": args},
        },
        texts,
        texts,
        arguments,
    )
    assistant = st.builds(
        lambda content, calls: {"role": "assistant", "content": content, "tool_calls": calls},
        st.sampled_from(["", "ok", None]),
        st.lists(calls, min_size=1, max_size=3),
    )
    tool = st.builds(
        lambda call_id, content: {"role": "tool", "tool_call_id": call_id, "content": content},
        texts,
        texts,
    )
    messages = st.lists(
        st.one_of(st.just({"role": "user", "content": "hi"}), assistant, tool),
        min_size=1,
        max_size=4,
    )
    chat = messages.map(
        lambda m: ("/v1/chat/completions", {"messages": m, "max_tokens": 2, "temperature": 0})
    )
    tokenize = messages.map(lambda m: ("/tokenize", {"messages": m}))
    parts = st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "input_text", "text": t}, texts),
            st.builds(
                lambda inner: {"type": "input_text", "text": [inner]},
                st.builds(lambda t: {"type": "text", "text": t}, texts),
            ),
            st.fixed_dictionaries({"type": texts}),
        ),
        max_size=3,
    )
    items = st.one_of(
        st.builds(lambda role, c: {"role": role, "content": c}, texts, st.one_of(texts, parts)),
        st.builds(
            lambda call_id, name, args: {
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": args,
            },
            texts,
            texts,
            st.one_of(arguments, hostile_values()),
        ),
        st.builds(
            lambda call_id, out: {
                "type": "function_call_output",
                "call_id": call_id,
                "output": out,
            },
            texts,
            st.one_of(texts, parts),
        ),
        st.dictionaries(st.sampled_from(["type", "role", "content", "call_id"]), texts, max_size=3),
    )
    responses = st.lists(items, min_size=1, max_size=4).map(
        lambda i: ("/v1/responses", {"input": i, "max_output_tokens": 2, "temperature": 0})
    )
    return st.one_of(chat, tokenize, responses)


def _inject(body: Any, value: Any, rnd: random.Random) -> Any:
    """`body` with `value` put at a random place inside it (a field of an object, an item
    of an array, or the whole of a nested container)."""
    containers: list[Any] = []
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list):
            containers.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    if not containers:
        return value
    target = rnd.choice(containers)
    if isinstance(target, dict):
        keys = [*target, "injected"]
        target[rnd.choice(keys)] = value
    elif target and rnd.random() < 0.5:
        target[rnd.randrange(len(target))] = value
    else:
        target.append(value)
    return body


def schema_cases(openapi: dict[str, Any]) -> Any:
    """(path, body) pairs drawn by schemathesis from the request schemas of every POST route
    of `openapi` (the server's own document), half of them with a `hostile_values()` value
    put somewhere inside; generation stays short where the body asks for tokens."""
    import schemathesis
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_dict(openapi)
    operations = [
        result.ok()
        for result in schema.get_all_operations()
        if result.ok().method.upper() == "POST" and result.ok().body
    ]
    drawn = st.one_of([operation.as_strategy() for operation in operations])

    limits = {
        "/v1/completions": ("max_tokens",),
        "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
        "/v1/responses": ("max_output_tokens",),
    }

    def build(case: Any, value: Any, inject: bool, rnd: random.Random) -> tuple[str, Any]:
        path, body = case.operation.path, case.body
        if isinstance(body, dict):
            for name in limits.get(path, ()):
                given = body.get(name)
                if not isinstance(given, int) or isinstance(given, bool) or given > 8:
                    body[name] = 8
        return path, _inject(body, value, rnd) if inject else body

    return st.builds(build, drawn, hostile_values(), st.booleans(), st.randoms())


def search_server_errors(
    base_url: str,
    *,
    max_examples: int,
    seed: int,
    headers: dict[str, str] | None = None,
    cases: Any = None,
    statuses: Counter[int] | None = None,
) -> None:
    """Post `cases` (default `request_cases()`) to the server; raise (with the smallest
    failing body that hypothesis finds) when one is answered 5xx or with a body that is not
    an error object. Each answer's status is counted in `statuses`."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed

    seen = statuses if statuses is not None else Counter()
    with httpx.Client(base_url=base_url, timeout=60, trust_env=False, headers=headers) as client:

        @with_seed(seed)
        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(cases if cases is not None else request_cases())
        def probe(case: tuple[str, Any]) -> None:
            path, body = case
            content = json.dumps(body).encode()
            response = client.post(
                path, content=content, headers={"content-type": "application/json"}
            )
            seen[response.status_code] += 1
            shape = (
                {key: str(value)[:80] for key, value in body.items()}
                if isinstance(body, dict)
                else str(body)[:80]
            )
            assert response.status_code < 500, (path, shape, response.text[:300])
            if response.status_code != 200:
                assert {"message", "type", "param", "code"} == set(response.json()["error"])

        probe()
