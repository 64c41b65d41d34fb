"""`otel-engine replay FILE`: run the failing batch of a crash dump again, without its prompts.

The dump file (`--crash-dump-dir`) holds the engine config and the failing step's batch by
numbers: each request's prompt and output lengths, the tokens computed and scheduled, its
sampling limits, the order, the step number. Replay builds the same engine (the dump's config,
command-line flags winning; `--model` when the dump's model path does not exist here), puts
requests of exactly those shapes into its scheduler with synthetic token ids and KV blocks,
and runs that one step, under the same `OTEL_ENGINE_FAULT` if one was set. A request samples
with the values the dump shows, except the fields `--override-generation-config` sets on the
replay's command line (`request_params`). It prints one line:

    replay: reproduced                                  exit 0 (same type in the same process)
    replay: no failure                                  exit 1
    replay: different failure: <type> in <process>      exit 2

What a dump does not keep is not replayed: prompt and output text (synthetic ids stand in),
stop strings, logit-bias ids, response_format schemas, and requests the 64 KiB cap left out
(said on stderr).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection, Mapping
from typing import Any

from otel_engine.config import EngineConfig
from otel_engine.observability.crash_dump import CHUNK_DRAFTS, CHUNK_START, CHUNK_TOKENS
from otel_engine.sampling_params import SamplingParams, apply_generation_defaults, parse_override
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import CacheTooSmall, SchedulerOutput

REPRODUCED, NO_FAILURE, DIFFERENT, UNUSABLE = 0, 1, 2, 3
# SamplingParams fields a dump shows by value (the others it shows as counts or flags),
# read from the redaction policy that wrote them
_VALUES = tuple(n for n, how in SamplingParams.__crash_dump__.items() if how == "value")
# Settings of the run that wrote the dump that a replay must not reuse
_NOT_REPLAYED = ("otlp_endpoint", "otlp_protocol", "otlp_logs", "crash_dump_dir", "multiprocess")


class ReplayError(Exception):
    """The dump cannot be replayed here (the message says why)."""


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            dump = json.load(file)
    except (OSError, ValueError) as error:
        raise ReplayError(f"cannot read {path}: {error}") from None
    for part in ("engine", "failure", "scheduler_output"):
        if not isinstance(dump, dict) or not isinstance(dump.get(part), dict):
            raise ReplayError(f"{path} has no {part!r} part: not a --crash-dump-dir file")
    return dump


def engine_options(
    dump: dict[str, Any], model: str | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    """`EngineConfig.from_kwargs` options: the dump's engine config, then `overrides`."""
    options: dict[str, Any] = {}
    for section in dump["engine"].values():
        if isinstance(section, dict):
            options.update(section)
    for name in _NOT_REPLAYED:
        options.pop(name, None)
    options.update(overrides)
    if model is not None:
        options["model"] = model
    path = options.get("model")
    if path is not None and not os.path.exists(path):
        raise ReplayError(f"the dump's model {path} does not exist here: pass --model PATH")
    return options


# The numbers of a dumped request a replay needs: its token counts (`Request`'s policy
# dumps both as counts) and its chunk of the failing step
_BATCH_KEYS = ("prompt_token_ids", "output_token_ids", CHUNK_START, CHUNK_TOKENS)


def check_batch(batch: dict[str, Any]) -> None:
    """ReplayError unless every listed request has the numbers a replay needs."""
    requests = batch.get("requests")
    if not isinstance(requests, list) or not requests:
        raise ReplayError("the dump lists no request of the failing batch")
    for index, entry in enumerate(requests):
        missing = [
            k
            for k in _BATCH_KEYS
            if not isinstance(entry, dict) or not isinstance(entry.get(k), int)
        ]
        if missing:
            raise ReplayError(f"request {index} of the dump has no {', '.join(missing)}")


def rebuild_batch(
    core: Any,
    batch: dict[str, Any],
    defaults: Mapping[str, float] | None = None,
    overridden: Collection[str] = (),
) -> SchedulerOutput:
    """The dump's failing step as a scheduled batch of synthetic requests in `core`'s
    scheduler, each holding the KV blocks its chunk needs (sampling: `request_params`)."""
    vocab = core.arch.vocab_size
    restored = []
    for index, entry in enumerate(batch.get("requests") or []):
        num_prompt, num_output = int(entry["prompt_token_ids"]), int(entry["output_token_ids"])
        start, count = int(entry[CHUNK_START]), int(entry[CHUNK_TOKENS])
        num_drafts = int(entry.get(CHUNK_DRAFTS) or 0)
        ids = [
            (index * 7919 + position) % (vocab - 1) + 1
            for position in range(num_prompt + num_output)
        ]
        request = Request(
            request_id=f"replay-{index}",
            prompt_token_ids=ids[:num_prompt],
            sampling_params=request_params(
                entry.get("sampling_params") or {}, defaults or {}, overridden
            ),
            eos_token_ids=core.eos_token_ids,
        )
        request.output_token_ids = ids[num_prompt:]
        # Proposed tokens the step verified: as synthetic as the rest, one per position.
        drafts = [(index * 7919 + start + count + k) % (vocab - 1) + 1 for k in range(num_drafts)]
        restored.append((request, start, count, drafts))
    try:
        return core.scheduler.restore(restored, int(batch.get("step_id") or 1))
    except CacheTooSmall as error:
        raise ReplayError(
            f"the KV cache here cannot hold the batch (request {error.index} needs "
            f"{error.num_tokens} tokens): pass --num-kv-blocks"
        ) from None


def overridden_fields(overrides: dict[str, Any]) -> set[str]:
    """The sampling fields the replay's own --override-generation-config sets."""
    return set(parse_override(overrides.get("override_generation_config")) or {})


def request_params(
    dumped: dict[str, Any], defaults: Mapping[str, float], overridden: Collection[str] = ()
) -> SamplingParams:
    """A replayed request's sampling parameters: the values its dump shows, but for the
    `overridden` fields (those --override-generation-config sets on the replay's command
    line); the generation `defaults` (the override's values among them) fill the rest."""
    given: dict[str, Any] = {
        name: dumped[name]
        for name in _VALUES
        if dumped.get(name) is not None and name not in overridden
    }
    given["seed"] = 0 if dumped.get("seed") else None
    return apply_generation_defaults(given, defaults)


def replay(path: str, model: str | None, overrides: dict[str, Any]) -> tuple[int, str]:
    """Replay the dump at `path`; the exit status and the line to print."""
    from otel_engine import LLM
    from otel_engine.engine.core_client import InprocClient
    from otel_engine.ipc.messages import EngineDead

    dump = load(path)
    options = {**engine_options(dump, model, overrides), "multiprocess": False}
    EngineConfig.from_kwargs(**dict(options))  # a clear error before anything starts
    batch = dump["scheduler_output"]
    check_batch(batch)
    omitted = int(batch.get("num_omitted_requests") or 0)
    if omitted:
        print(f"replay: {omitted} requests were left out of the dump", file=sys.stderr)
    expected = (dump["failure"].get("type"), dump["failure"].get("process"))
    llm = LLM(**options)
    try:  # shut down on every way out: a batch that cannot be rebuilt included
        client = llm._frontend.client
        if not isinstance(client, InprocClient):
            raise ReplayError("replay runs the engine core in this process")
        defaults = llm.generation_defaults.values
        batch_run = rebuild_batch(client.core, batch, defaults, overridden_fields(overrides))
        result = client.run_batch(batch_run)
    finally:
        llm.shutdown()
    if not isinstance(result, EngineDead):
        return NO_FAILURE, "replay: no failure"
    got = (result.error.type, result.error.process)
    if got == expected:
        return REPRODUCED, "replay: reproduced"
    return DIFFERENT, f"replay: different failure: {got[0]} in {got[1]}"
