"""`LLM`: synchronous offline generation over a batch of prompts.

It enables `faulthandler` on stderr (unless the caller already set it up): a native fault
in the engine, which runs in this process, writes its signal and stack there before the
interpreter dies.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from functools import cached_property
from typing import Any, cast

from otel_engine.config import EngineConfig, EngineFailureMode
from otel_engine.engine import generation_defaults
from otel_engine.engine.chat import ChatRenderer
from otel_engine.engine.frontend import Frontend, dead_error
from otel_engine.errors import EngineDeadError, FailureCause
from otel_engine.ipc.messages import EngineDead, StepOutputs
from otel_engine.ipc.native_fault import enable_on_stderr
from otel_engine.outputs import RequestOutput
from otel_engine.sampling_params import SamplingParams


class LLM:
    """Offline batch generation. The engine core runs in this process unless
    `multiprocess=True` is given; tensor-parallel workers are processes either way.

    >>> with LLM(model="path/to/model") as llm:
    ...     outputs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    ...     answers = llm.chat([{"role": "user", "content": "Hello"}])
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        enable_on_stderr()
        self.config = EngineConfig.from_kwargs(model=model, **options)
        if self.config.recovery.on_engine_failure != EngineFailureMode.SHUTDOWN:
            raise ValueError(
                "on_engine_failure='restart' is the server's (AsyncLLM): an offline batch "
                "fails with its engine"
            )
        self._frontend = Frontend(self.config)
        self.tokenizer = self._frontend.tokenizer
        self.max_model_len = self._frontend.max_model_len
        self.generation_defaults = self._frontend.generation_defaults
        self._counter = itertools.count()
        self._finalizer = weakref.finalize(self, self._frontend.shutdown)

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the model's generation defaults (its
        `generation_config.json`, or the default model's card, then
        --override-generation-config), the values the server gives requests that omit them."""
        return generation_defaults.apply_generation_defaults({}, self.generation_defaults.values)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs are in prompt order.

        Without `sampling_params`, each prompt gets `default_sampling_params()`: the
        model's generation config, as the server applies it to requests that omit those
        fields. Raises RequestError for an invalid prompt (nothing is run then), the error of a
        request that failed on its own (the rest of the batch is aborted; the engine keeps
        serving), and EngineDeadError if the engine fails (the engine is shut down).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_list: list[str | list[int]] = list(prompts)
        params = sampling_params if sampling_params is not None else self.default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt, or a single one")
        frontend = self._frontend
        if not self._finalizer.alive:
            raise EngineDeadError(
                "the engine is shut down", cause_type=FailureCause.ENGINE_SHUTDOWN
            )
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        # Validate every prompt before any runs: a bad one fails the call, not the batch.
        token_ids = [
            frontend.inputs.process(q, p) for q, p in zip(prompt_list, params_list, strict=True)
        ]
        for request_id, prompt, p, ids_ in zip(
            ids, prompt_list, params_list, token_ids, strict=True
        ):
            frontend.add_request(request_id, prompt, p, ids_)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            output = frontend.client.get_output()
            if isinstance(output, EngineDead):
                self.shutdown()
                raise dead_error(output)
            if isinstance(output, StepOutputs):
                processed = frontend.outputs.process(output)
                frontend.client.abort_requests(processed.to_abort)
                if processed.failures:
                    frontend.abort([i for i in ids if i not in finished])
                    raise processed.failures[0][1]
                finished.update((r.request_id, r) for r in processed.outputs if r.finished)
        return [finished[request_id] for request_id in ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (`{"role", "content"}` messages) or a list of them, in
        order. Each is rendered as the server renders a chat request (`ChatRenderer`: the
        model's chat template, a special token's text in content stays text), then run as
        `generate` runs prompts (without `sampling_params`: the model's defaults). Raises
        RequestError for a chat the template cannot render (nothing is run then)."""
        conversations = cast("Sequence[Sequence[dict[str, Any]]]", messages)
        if messages and isinstance(messages[0], dict):
            conversations = [cast("Sequence[dict[str, Any]]", messages)]
        prompts = [self._chat_renderer.render(list(chat))[1] for chat in conversations]
        return self.generate(prompts, sampling_params)

    @cached_property
    def _chat_renderer(self) -> ChatRenderer:
        return ChatRenderer(self.tokenizer)

    def shutdown(self) -> None:
        """Stop the engine and every process it started; idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
