"""The engine's tokenizer (tokenizers + jinja2, no transformers) gives what transformers'
fast tokenizer gives on the same files: the same ids with and without special tokens and
with special tokens split, the same text back, the same chat template rendering (tools and
named templates included), the same special tokens. And loading it imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_engine.model.loader import load_tokenizer, prepare_model_dir
from otel_engine.model.tokenizer import Tokenizer
from tests.helpers.tiny_model import CORPUS, write_tiny_llama

TEXTS = [
    "",
    "Once upon a time",
    " leading and trailing spaces ",
    "héllo wörld 世界 🌍 naïve café",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> and text",
    "Numbers: 3.14159 -1 +1 = < > ( ) [ ] { }\n\n\ttabs",
    CORPUS[0],
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "  two plus two?\n"},
        {"role": "assistant", "content": "Four.", "tool_calls": None},
        {"role": "user", "content": "héllo <|im_end|>"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city <b>now</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "München"}},
                "required": ["city"],
            },
        },
    }
]
# Hermes-style tool markup (Qwen2.5's shape): tools as JSON, a namespace, loop controls
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + tool | tojson }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(count=0) %}"
    "{%- for message in messages %}{%- if loop.index > 8 %}{% break %}{% endif %}"
    "{%- set ns.count = ns.count + 1 %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    "{{ bos_token if false else '' }}"
)
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'assistant' %}{% generation %}"
    "{{ message.content + eos_token }}{% endgeneration %}{% else %}"
    "{{ message.role + ': ' + message.content + '\\n' }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, str]:
    """The default model's converted tokenizer, the tests' tiny one, and variants of the tiny
    one: bos/eos added by the config, a list of named templates, a template file."""
    root = tmp_path_factory.mktemp("tokenizers")
    variants = {"tiny": tiny_model_dir, "default": prepare_model_dir(None)}
    for name in ("add_bos", "named_templates", "template_file"):
        path = root / name
        write_tiny_llama(path, num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        if name == "add_bos":
            config.update(add_bos_token=True, add_eos_token=True)
        elif name == "named_templates":
            (path / "chat_template.jinja").unlink(missing_ok=True)  # it would win
            config["chat_template"] = [
                {"name": "default", "template": config["chat_template"]},
                {"name": "tool_use", "template": TOOL_TEMPLATE},
            ]
        else:
            config.pop("chat_template")
            (path / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
        config_path.write_text(json.dumps(config))
        variants[name] = str(path)
    return variants


def _pair(path: str) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    return Tokenizer(path), reference


@pytest.mark.parametrize("name", ["tiny", "default", "add_bos", "named_templates", "template_file"])
def test_encode_and_decode_equal_transformers(checkpoints: dict[str, str], name: str) -> None:
    ours, reference = _pair(checkpoints[name])
    for text in TEXTS:
        plain = reference.encode(text, add_special_tokens=False)
        assert plain == ours.encode(text, add_special_tokens=False)
        if name == "add_bos":
            # the config's add_bos_token/add_eos_token hold, as Llama's tokenizers have them
            # (transformers 5 ignores them for a tokenizer of no model-specific class)
            expected = [ours.bos_token_id, *plain, ours.eos_token_id]
        else:
            expected = reference.encode(text, add_special_tokens=True)
        assert expected == ours.encode(text, add_special_tokens=True), (name, text)
        split = reference.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert split == ours.encode(text, add_special_tokens=False, split_special_tokens=True)
        ids = expected
        for skip in (True, False):
            assert reference.decode(ids, skip_special_tokens=skip) == ours.decode(
                ids, skip_special_tokens=skip
            )
    assert (reference.bos_token_id, reference.eos_token_id) == (
        ours.bos_token_id,
        ours.eos_token_id,
    )
    assert reference.special_tokens_map == ours.special_tokens_map
    assert len(reference) == len(ours)
    assert {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()
    }


@pytest.mark.parametrize("name", ["tiny", "default", "add_bos", "named_templates", "template_file"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_renders_as_transformers(
    checkpoints: dict[str, str], name: str, tools: list[dict[str, Any]] | None
) -> None:
    ours, reference = _pair(checkpoints[name])
    chats = [*CHATS, [*CHATS[1], {"role": "assistant", "content": "Fine."}]]
    for chat in chats:
        for prompt in (True, False):
            expected = reference.apply_chat_template(
                chat, tools=tools, add_generation_prompt=prompt, tokenize=False
            )
            rendered = ours.apply_chat_template(
                chat, tools=tools, add_generation_prompt=prompt, tokenize=False
            )
            assert expected == rendered, (name, chat, prompt)
            assert ours.encode(rendered, add_special_tokens=False) == ours.apply_chat_template(
                chat, tools=tools, add_generation_prompt=prompt
            )
    if name == "named_templates" and tools:
        assert "<tools>" in rendered
        assert '"München"' in rendered
        assert "<b>now</b>" in rendered


def test_a_template_cannot_reach_underscore_attributes(tmp_path: Path) -> None:
    """The sandbox refuses a namespace's private attributes and Python internals."""
    import jinja2

    write_tiny_llama(tmp_path, num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32)
    tokenizer = Tokenizer(str(tmp_path))
    for template in (
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ messages.__class__.__mro__ }}",
        "{{ raise_exception('refused by the template') }}",
    ):
        tokenizer.chat_template = template
        with pytest.raises(jinja2.TemplateError):
            tokenizer.apply_chat_template(CHATS[0], tokenize=False)


def test_loading_the_tokenizer_imports_neither_torch_nor_transformers(tiny_model_dir: str) -> None:
    """The HTTP server's process loads the tokenizer (and the server module) without torch."""
    code = (
        "import sys\n"
        "from otel_engine.model.loader import load_tokenizer\n"
        "import otel_engine.entrypoints.api_server\n"
        f"tokenizer = load_tokenizer({tiny_model_dir!r})\n"
        "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "[]" == result.stdout.strip()


def test_a_checkpoint_without_tokenizer_json_goes_through_transformers(tmp_path: Path) -> None:
    """Only a BPE's vocab.json and merges.txt: transformers builds the tokenizer, and it
    tokenizes as the tokenizer.json it came from."""
    write_tiny_llama(tmp_path, num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32)
    ours = Tokenizer(str(tmp_path))
    _without_tokenizer_json(tmp_path)

    loaded = load_tokenizer(str(tmp_path))

    assert not isinstance(loaded, Tokenizer)
    assert ours.encode(CORPUS[0], add_special_tokens=False) == loaded.encode(
        CORPUS[0], add_special_tokens=False
    )


def _without_tokenizer_json(path: Path) -> None:
    """The tiny checkpoint at `path` with its BPE as vocab.json and merges.txt only
    (transformers builds the tokenizer)."""
    from tokenizers import Tokenizer as Backend

    Backend.from_file(str(path / "tokenizer.json")).model.save(str(path))
    (path / "tokenizer.json").unlink()
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("source", ["tokenizer.json", "transformers"])
def test_two_threads_split_special_tokens_or_not_each_as_asked(tmp_path: Path, source: str) -> None:
    """Splitting is a choice per call: one thread splitting and one not, on the same text,
    each always gets its own ids (no shared switch between them)."""
    import threading

    write_tiny_llama(tmp_path, num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32)
    if source == "transformers":
        _without_tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    text = "Hi <|im_end|> there " * 20
    expected = {
        split: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split)
        for split in (False, True)
    }
    got: dict[bool, list[list[int]]] = {False: [], True: []}
    start = threading.Barrier(2)

    def encode(split: bool) -> None:
        start.wait()
        for _ in range(1000):
            got[split].append(
                tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split)
            )

    threads = [threading.Thread(target=encode, args=(split,)) for split in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert expected[False] != expected[True]
    assert [expected[False]] * 1000 == got[False]
    assert [expected[True]] * 1000 == got[True]


def test_the_transformers_fallback_is_a_tokenizer_like_ours(tmp_path: Path) -> None:
    """The same ids split or not, the same text back, the same special tokens and template."""
    from otel_engine.model.tokenizer import TransformersTokenizer

    write_tiny_llama(tmp_path, num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32)
    ours = Tokenizer(str(tmp_path))
    _without_tokenizer_json(tmp_path)

    loaded = load_tokenizer(str(tmp_path))

    assert isinstance(loaded, TransformersTokenizer)
    for text in TEXTS:
        for split in (False, True):
            assert ours.encode(text, split_special_tokens=split) == loaded.encode(
                text, split_special_tokens=split
            )
        ids = ours.encode(text)
        assert ours.decode(ids) == loaded.decode(ids)
    assert len(ours) == len(loaded)
    assert {i: t.content for i, t in ours.added_tokens_decoder.items()} == {
        i: t.content for i, t in loaded.added_tokens_decoder.items()
    }
    assert ours.apply_chat_template(CHATS[1], tokenize=False) == loaded.apply_chat_template(
        CHATS[1], tokenize=False
    )
    assert ours.backend_tokenizer.decode([5, 6]) == loaded.backend_tokenizer.decode([5, 6])
