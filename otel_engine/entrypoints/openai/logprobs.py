"""Logprobs in OpenAI's two shapes: completions (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and chat (`content[]` with `token`, `logprob`, `bytes`, `top_logprobs`).

Token strings are each token decoded alone (special tokens included), as vLLM shows them; a
token that is part of a multi-byte character decodes to U+FFFD. `bytes` are the token's own
bytes, as OpenAI defines them: the bytes of consecutive tokens join into the text's UTF-8
even where a character spans tokens (byte-level BPE and byte-fallback tokens are mapped back
to their bytes; other tokens are the UTF-8 of their text). In the completions shape,
alternatives that decode to the same string share one key (the most likely one's value).
A logprob of -inf (a token the model cannot emit) is written as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from tokenizers import decoders

from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.outputs import TokenLogprobs

NEG_INF_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class LogprobsFormatter:
    """Builds the `logprobs` object of a choice from the engine's per-token entries."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
        decoder = self._backend.decoder
        self._byte_level = isinstance(decoder, decoders.ByteLevel)
        self._token_bytes = lru_cache(maxsize=65536)(self._raw_bytes)

    def _raw_bytes(self, token_id: int) -> tuple[int, ...]:
        """The bytes token `token_id` stands for in the text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return ()
        if token_id not in self._special:
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return tuple(_UNICODE_TO_BYTE[c] for c in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return (int(match.group(1), 16),)
            if not self._byte_level:
                piece = piece.replace("\u2581", " ")  # SentencePiece's word boundary
        return tuple(piece.encode("utf-8", errors="replace"))

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
        for token_id, token, entry in zip(
            token_ids, strings[: len(token_ids)], entries, strict=True
        ):
            top = []
            for top_id, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
                name, raw = next(alternatives), list(self._token_bytes(top_id))
                top.append({"token": name, "logprob": _finite(value), "bytes": raw})
            content.append(
                {
                    "token": token,
                    "logprob": _finite(entry.logprob),
                    "bytes": list(self._token_bytes(token_id)),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character a byte-level BPE
    vocabulary writes it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
