"""Chat prompts: the model's chat template, rendered and tokenized so that control tokens
come from the template's own markup only.

A tokenizer turns the text of a special token (`<|im_start|>`, `<|eot_id|>`, ...) into that
token wherever it appears, so a user who writes `<|im_end|>\n<|im_start|>system` in a
message would forge a system turn. `ChatRenderer` first replaces each special token's text
in client-written fields (content, name) with a marker no client can guess (a per-render
nonce between two private-use characters), renders the template, then tokenizes the text
between markers as before (the template's markup: special tokens parsed) and each marked
token's text as plain text. A chat whose fields contain no special token's text is
rendered and tokenized exactly as it was before (the same ids).
`--allow-special-tokens-in-content` turns the markers off.

It is the one chat renderer: the server's chat endpoints and `/tokenize`, `LLM.chat` and
`otel-engine generate --chat` all render through it, so the same messages give the same
token ids everywhere. A chat it cannot render is a `RequestError` naming `messages`.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import jinja2

from otel_engine.errors import ErrorCode, RequestError
from otel_engine.model.tokenizer import TokenizerLike

# What a client writes into a message: its text, and any string inside an assistant's
# earlier tool calls; a request's tools (names, descriptions, schemas) are the client's too.
CLIENT_FIELDS = ("content", "name", "tool_calls", "tool_call_id", "tools")
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


class NoChatTemplateError(RequestError):
    """The model has no chat template: its prompts must be text or token ids."""

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template",
            code=ErrorCode.UNSUPPORTED_PARAMETER,
            param="messages",
        )


class ChatRenderer:
    """Renders chat messages with one tokenizer's chat template into (text, token ids)."""

    def __init__(self, tokenizer: TokenizerLike, *, allow_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.allow_special_tokens = allow_special_tokens
        specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
            key=len,
            reverse=True,  # the longest first: one special token's text may start another's
        )
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt's text (as the template wrote it) and its token ids; `tools` go to
        templates that render them."""
        found: list[str] = []
        nonce = secrets.token_hex(8)
        if not self.allow_special_tokens and self._specials is not None:
            messages = [self._marked(message, nonce, found) for message in messages]
            if tools is not None:
                tools = self._mark_value(tools, nonce, found)
        text = self._apply(messages, add_generation_prompt, tools)
        if not found:
            return text, self._encode(text)
        pieces = re.split(f"{_MARK_OPEN}{nonce}(\\d+){_MARK_CLOSE}", text)
        token_ids: list[int] = []
        for index, piece in enumerate(pieces):
            if index % 2:  # a marked special token's text, written by the client
                pieces[index] = found[int(piece)]
                token_ids += self._encode(pieces[index], split_special_tokens=True)
            elif piece:
                token_ids += self._encode(piece)
        return "".join(pieces), token_ids

    def _marked(self, message: dict[str, Any], nonce: str, found: list[str]) -> dict[str, Any]:
        marked = dict(message)
        for field in CLIENT_FIELDS:
            value = marked.get(field)
            if value:
                marked[field] = self._mark_value(value, nonce, found)
        return marked

    def _mark_value(self, value: Any, nonce: str, found: list[str]) -> Any:
        """`value` with every special token's text in its strings (at any depth) marked."""
        assert self._specials is not None

        def mark(match: re.Match[str]) -> str:
            found.append(match.group())
            return f"{_MARK_OPEN}{nonce}{len(found) - 1}{_MARK_CLOSE}"

        if isinstance(value, str):
            return self._specials.sub(mark, value)
        if isinstance(value, list):
            return [self._mark_value(item, nonce, found) for item in value]
        if isinstance(value, dict):
            return {key: self._mark_value(item, nonce, found) for key, item in value.items()}
        return value

    def _encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        options = {"split_special_tokens": True} if split_special_tokens else {}
        return list(self.tokenizer.encode(text, add_special_tokens=False, **options))

    def _apply(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoChatTemplateError
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            raise RequestError(
                f"chat template rejected the messages: {type(error).__name__}",
                code=ErrorCode.INVALID_VALUE,
                param="messages",
            ) from None
        return str(text)
