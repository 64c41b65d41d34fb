"""The engine core never dies of a request: whatever a batch mixes (valid requests, extreme
values, values no front end would let through), every request ends on its own, refused or
finished, and the engine keeps serving with every KV block free again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_engine import LLM, SamplingParams
from otel_engine.engine.core_client import InprocClient
from otel_engine.ipc.messages import AddRequest, EngineDead, StepOutputs
from otel_engine.sampling_params import StructuredOutput

VOCAB = 768  # tests/helpers/tiny_model.py
CONTEXT = 512
INT64 = 2**63

TINY = [5e-324, 1e-50, 1e-45, 1e-38, 1e-5]
temperatures = st.one_of(
    st.floats(min_value=0.0, max_value=2.0, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 2.0, *TINY]),
)
top_ps = st.one_of(
    st.floats(min_value=5e-324, max_value=1.0, allow_subnormal=True),
    st.sampled_from([1.0, *TINY]),
)
valid_token = st.integers(0, VOCAB - 1)
valid_request = st.tuples(
    st.lists(valid_token, min_size=1, max_size=40),
    st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 6),
        temperature=temperatures,
        top_p=top_ps,
        top_k=st.one_of(st.integers(-1, VOCAB), st.sampled_from([-1, 0, 1, VOCAB])),
        seed=st.one_of(st.none(), st.sampled_from([-INT64, INT64 - 1, 0]), st.integers()),
        stop_token_ids=st.lists(valid_token, max_size=3).map(tuple),
        ignore_eos=st.booleans(),
        min_tokens=st.sampled_from([0, 0, 1]),
        structured_output=st.one_of(
            st.none(),
            st.none(),
            st.sampled_from(
                [StructuredOutput("json_object"), StructuredOutput("json_schema", '{"enum":[7]}')]
            ),
        ),
    ).filter(lambda p: p.seed is None or -INT64 <= p.seed < INT64),
)
BAD_STRUCTURED = [
    StructuredOutput("xml"),
    StructuredOutput("json_schema"),
    StructuredOutput("json_schema", "not json"),
    StructuredOutput("json_schema", '{"type": "objekt"}'),
    StructuredOutput("json_schema", '{"type": "string", "pattern": "(("}'),
    StructuredOutput("json_schema", '{"enum": ["' + "x" * 70_000 + '"]}'),
]
# Values no front end lets through: the core must refuse them, never die of them.
bad_floats = st.sampled_from([-1.0, 2.5, float("nan"), float("inf"), -float("inf")])
bad_token = st.sampled_from([-1, VOCAB, INT64 - 1, -INT64, 2**70])
invalid_request = st.one_of(
    st.tuples(st.lists(bad_token, max_size=4), st.just(SamplingParams(max_tokens=2))),
    st.tuples(
        st.lists(valid_token, min_size=1, max_size=8),
        st.one_of(
            st.builds(SamplingParams, temperature=bad_floats),
            st.builds(SamplingParams, top_p=st.one_of(bad_floats, st.just(0.0))),
            st.builds(SamplingParams, top_k=st.sampled_from([-2, VOCAB + 1, 2**62, 2**70])),
            st.builds(SamplingParams, seed=st.sampled_from([INT64, -INT64 - 1, 2**80])),
            st.builds(SamplingParams, max_tokens=st.sampled_from([0, -1, CONTEXT, 10**12])),
            st.builds(SamplingParams, stop_token_ids=st.lists(bad_token, min_size=1).map(tuple)),
            st.builds(SamplingParams, structured_output=st.sampled_from(BAD_STRUCTURED)),
        ),
    ),
)
requests = st.one_of(valid_request, valid_request, valid_request, invalid_request)


@pytest.fixture(scope="module")
def client(tiny_model_dir: str) -> Iterator[InprocClient]:
    """The engine core of an in-process LLM, driven directly: no front-end validation."""
    llm = LLM(model=tiny_model_dir, num_kv_blocks=32, max_num_seqs=4)
    core_client = llm._frontend.client
    assert isinstance(core_client, InprocClient)
    yield core_client
    llm.shutdown()


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(requests, min_size=1, max_size=6))
def test_no_batch_kills_the_engine(
    client: InprocClient, batch: list[tuple[list[int], SamplingParams]]
) -> None:
    """Every request of the batch gets a last update (refused with a reason, or finished),
    no output is EngineDead, and the cache is whole again afterwards."""
    ids = [f"h{time.monotonic_ns()}-{index}" for index in range(len(batch))]
    for request_id, (prompt, params) in zip(ids, batch, strict=True):
        client.add_request(AddRequest(request_id, prompt, params, time.time()))

    ended: dict[str, str] = {}
    for _ in range(10_000):
        if len(ended) == len(ids):
            break
        output = client.get_output()
        if output is None:  # nothing to step: a grammar is being built
            continue
        assert not isinstance(output, EngineDead), output
        assert isinstance(output, StepOutputs)
        for update in output.updates:
            if update.rejected is not None:
                ended[update.request_id] = f"refused: {update.rejected.code}"
            elif update.finish_reason is not None:
                ended[update.request_id] = update.finish_reason

    assert set(ids) == set(ended)
    assert not client.core.compiling
    scheduler = client.core.scheduler
    assert not scheduler.has_unfinished
    assert scheduler.allocator.num_blocks == scheduler.allocator.num_free_blocks
