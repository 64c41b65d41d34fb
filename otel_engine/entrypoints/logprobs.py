"""Logprobs in OpenAI's two shapes: completions (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and chat (`content[]` with `token`, `logprob`, `bytes`, `top_logprobs`).

Token strings are each token decoded alone (special tokens included), as vLLM shows them; a
token that is part of a multi-byte character decodes to U+FFFD, and `bytes` are the UTF-8
of that string. In the completions shape, alternatives that decode to the same string share
one key (the most likely one's value). A logprob of -inf (a token the model cannot emit) is
written as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from otel_engine.ipc.messages import TokenLogprobs

NEG_INF_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class LogprobsFormatter:
    """Builds the `logprobs` object of a choice from the engine's per-token entries."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = tokenizer.backend_tokenizer

    def _strings(self, token_ids: Sequence[int]) -> list[str]:
        return list(self._backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False))

    def completion(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], text_offset: int
    ) -> tuple[dict[str, Any], int]:
        """The completions shape for these tokens, whose text starts at `text_offset` of the
        choice's text; and the offset after them (for the next streamed chunk)."""
        strings = self._strings([*token_ids, *(t for e in entries for t in e.top_token_ids)])
        tokens, alternatives = strings[: len(token_ids)], iter(strings[len(token_ids) :])
        offsets, top = [], []
        for token, entry in zip(tokens, entries, strict=True):
            offsets.append(text_offset)
            text_offset += len(token)
            choices: dict[str, float] = {}
            for value in entry.top_logprobs:  # most likely first; tokens that decode alike
                choices.setdefault(next(alternatives), _finite(value))  # share one key
            choices.setdefault(token, _finite(entry.logprob))
            top.append(choices)
        body = {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }
        return body, text_offset

    def prompt(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs]
    ) -> tuple[dict[str, Any], int]:
        """The completions shape for an echoed prompt: its first token has no logprob (no
        token before it), the others score it given the tokens before; and the offset of
        the text after the prompt's tokens."""
        body, offset = self.completion(token_ids[1:], entries, 0)
        first = self._strings(token_ids[:1])
        shift = len(first[0]) if first else 0
        body["tokens"] = first + body["tokens"]
        body["token_logprobs"] = [None] * len(first) + body["token_logprobs"]
        body["top_logprobs"] = [None] * len(first) + body["top_logprobs"]
        body["text_offset"] = [0] * len(first) + [o + shift for o in body["text_offset"]]
        return body, offset + shift

    def chat(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The chat shape (`content`) for these tokens."""
        strings = self._strings([*token_ids, *(t for e in entries for t in e.top_token_ids)])
        alternatives = iter(strings[len(token_ids) :])
        content = []
        for token, entry in zip(strings[: len(token_ids)], entries, strict=True):
            top = []
            for value in entry.top_logprobs:
                name = next(alternatives)
                top.append({"token": name, "logprob": _finite(value), "bytes": _utf8(name)})
            content.append(
                {
                    "token": token,
                    "logprob": _finite(entry.logprob),
                    "bytes": _utf8(token),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
