"""What `LLM.generate` returns and `AsyncLLM.generate` yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request. `text` and `token_ids` are cumulative;
    `delta_text` / `delta_token_ids` are what this output added (for streaming)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
