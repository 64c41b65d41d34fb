"""A checkpoint's tokenizer and chat template read with the Rust `tokenizers` library and
jinja2 alone.

transformers' tokenizer classes import torch (their configuration code does), 340 MB of
resident memory in a process that never runs a model: the HTTP server's. `Tokenizer` reads
the same files (tokenizer.json, tokenizer_config.json, special_tokens_map.json and the
chat template files) and offers the part of transformers' fast-tokenizer interface the
engine uses: `encode`, `decode`, `apply_chat_template`, `added_tokens_decoder`,
`chat_template`, the named special tokens and `backend_tokenizer`.

What it does as transformers' `TokenizersBackend` does (tests/model/test_tokenizer.py
compares the two on the default model and the test checkpoints):
- the post-processor of tokenizer.json, rebuilt from `add_bos_token`/`add_eos_token` when the
  config sets either (or the file has none);
- named special tokens that are missing from the vocabulary are added as special tokens;
- `clean_up_tokenization_spaces` from the config, never for a BPE model (it would delete
  spaces before punctuation);
- the chat template from `chat_template.jinja`, `additional_chat_templates/*.jinja` or the
  config, rendered in a sandbox with trim_blocks/lstrip_blocks, loop controls, the
  `tojson` filter without HTML escaping, `raise_exception` and `strftime_now`, and the named
  special tokens as variables; with tools, a template named `tool_use` is preferred.

What it leaves out: tokenizers without a tokenizer.json (sentencepiece files only) go
through transformers (`load_tokenizer`), and transformers' model-specific classes, which
may rebuild the pipeline from the vocabulary with their own pre-tokenizer, are not
imitated: tokenizer.json is the tokenizer, as for llama.cpp's converter and TGI.

`TokenizerLike` is what the engine reads of a tokenizer; both `Tokenizer` and
`TransformersTokenizer` (transformers' tokenizer behind a lock) are one, and may be called
from several threads at once. Splitting special tokens is a choice per call, never shared
state: `Tokenizer` holds a second backend that splits them, built once.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TOKENIZER_FILE = "tokenizer.json"


def has_tokenizer_file(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE))


class TokenizerLike(Protocol):
    """What the engine reads of a tokenizer (every method safe from several threads)."""

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...

    @property
    def added_tokens_decoder(self) -> Mapping[int, AddedToken]: ...

    @property
    def backend_tokenizer(self) -> BackendTokenizer:
        """The Rust tokenizer, for decoding only (output streams, logprobs)."""
        ...

    def __len__(self) -> int: ...

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        split_special_tokens: bool | None = None,
    ) -> list[int]: ...

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str: ...

    def get_chat_template(self, tools: list[dict[str, Any]] | None = None) -> str: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> Any: ...


class Tokenizer:
    """One checkpoint directory's tokenizer (see the module docstring)."""

    def __init__(self, model_dir: str) -> None:
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        legacy_map = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
        self.backend_tokenizer = BackendTokenizer.from_file(os.path.join(model_dir, TOKENIZER_FILE))
        self.special_tokens_map: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            value = _token_text(config.get(name, legacy_map.get(name)))
            if value is not None:
                self.special_tokens_map[name] = value
        self._add_missing_special_tokens()
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or self.backend_tokenizer.post_processor is None:
            self._update_post_processor()
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        if type(self.backend_tokenizer.model).__name__ == "BPE":
            self.clean_up_tokenization_spaces = False
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        self.chat_template: str | dict[str, str] | None = _chat_templates(model_dir, config)
        # one backend per way of reading special tokens' text, neither ever changed again
        self.backend_tokenizer.encode_special_tokens = False
        self._splitting_backend = copy.copy(self.backend_tokenizer)
        self._splitting_backend.encode_special_tokens = True

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        split_special_tokens: bool | None = None,
    ) -> list[int]:
        """Token ids of `text`; with `split_special_tokens` a special token's text is
        tokenized as plain text."""
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        backend = self._splitting_backend if split else self.backend_tokenizer
        # encode_batch releases the GIL while it works (encode does not): a long prompt is
        # tokenized in the server's tokenizer thread without stopping its event loop.
        return list(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def get_chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The template to render with: with tools, one named `tool_use` if there is one."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"no default among the chat templates {sorted(templates)}")
        if templates is None:
            raise ValueError("this tokenizer has no chat template")
        return templates

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> Any:
        """The conversation rendered by the chat template: its text, or with `tokenize`
        its token ids (no special tokens added: the template writes them)."""
        template = _compiled(self.get_chat_template(tools))
        messages = [
            {key: value for key, value in message.items() if value is not None}
            for message in conversation
        ]
        text = template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def _add_missing_special_tokens(self) -> None:
        missing = [
            AddedToken(token, special=True)
            for token in dict.fromkeys(self.special_tokens_map.values())
            if self.backend_tokenizer.token_to_id(token) is None
        ]
        if missing:
            self.backend_tokenizer.add_special_tokens(missing)

    def _update_post_processor(self) -> None:
        """transformers' template post-processor: bos before and eos after as configured."""
        bos, eos = self.bos_token, self.eos_token
        self.add_bos_token = self.add_bos_token and bos is not None
        self.add_eos_token = self.add_eos_token and eos is not None
        head = f"{bos}:0 " if self.add_bos_token else ""
        tail = f" {eos}:0" if self.add_eos_token else ""
        single = f"{head}$A:0{tail}"
        pair = (
            f"{single}{f' {bos}:1' if self.add_bos_token else ''} $B:1"
            f"{f' {eos}:1' if self.add_eos_token else ''}"
        )
        special: list[tuple[str, int]] = []
        if self.add_bos_token:
            special.append((str(bos), int(self.bos_token_id or 0)))
        if self.add_eos_token:
            special.append((str(eos), int(self.eos_token_id or 0)))
        self.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )


class TransformersTokenizer:
    """transformers' fast tokenizer (a checkpoint without tokenizer.json) as a
    `TokenizerLike`. Its `encode` switches its backend's shared `encode_special_tokens`
    when asked to split special tokens, so its calls are taken one at a time, and readers
    of `backend_tokenizer` get a copy that is never switched."""

    def __init__(self, tokenizer: Any) -> None:
        self.transformers = tokenizer
        self._lock = threading.Lock()
        self._backend: BackendTokenizer = copy.copy(tokenizer.backend_tokenizer)
        self._backend.encode_special_tokens = False

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        template = self.transformers.chat_template
        return template if isinstance(template, str | dict) else None

    @property
    def added_tokens_decoder(self) -> Mapping[int, AddedToken]:
        return dict(self.transformers.added_tokens_decoder)

    @property
    def backend_tokenizer(self) -> BackendTokenizer:
        return self._backend

    def __len__(self) -> int:
        return len(self.transformers)

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        split_special_tokens: bool | None = None,
    ) -> list[int]:
        options: dict[str, bool] = {"add_special_tokens": add_special_tokens}
        if split_special_tokens is not None:
            options["split_special_tokens"] = split_special_tokens
        with self._lock:
            ids = self.transformers.encode(text, **options)
        return list(ids)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        with self._lock:
            return str(self.transformers.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def get_chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        return str(self.transformers.get_chat_template(tools=tools))

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> Any:
        with self._lock:
            return self.transformers.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                **template_kwargs,
            )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        loaded = json.load(file)
    return loaded if isinstance(loaded, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: its text or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(model_dir: str, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's chat template(s), in transformers' order: chat_template.jinja and the
    additional_chat_templates folder, else the config's (a string or a list of named ones)."""
    templates: dict[str, str] = {}
    single = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(single):
        with open(single, encoding="utf-8") as file:
            templates["default"] = file.read()
    folder = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jinja"):
                with open(os.path.join(folder, name), encoding="utf-8") as file:
                    templates[name.removesuffix(".jinja")] = file.read()
    if not templates:
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return configured
        if isinstance(configured, list):
            templates = {
                entry["name"]: entry["template"]
                for entry in configured
                if isinstance(entry, dict) and "name" in entry and "template" in entry
            }
    if not templates:
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which a prompt must not have
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot be {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training):
    rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _Namespace
    return environment.from_string(template)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces a WordPiece decoder leaves before punctuation."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
