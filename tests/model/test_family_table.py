"""The one family table (`families.FAMILIES`) is consistent: every family's decoder class loads,
every `architectures` name and every GGUF kind (with or without experts) belongs to one family,
and the table is read without torch."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from otel_engine.model.families import (
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_GGUF_KINDS,
    Family,
    family_named,
    family_of,
    gguf_kind,
)
from otel_engine.model.llama import LlamaModel
from otel_engine.model.registry import decoder_class
from tests.helpers.tiny_model import FAMILY_CONFIGS


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_familys_decoder_class_loads(family: Family) -> None:
    cls = decoder_class(family)

    assert issubclass(cls, LlamaModel)
    assert family.decoder == f"{cls.__module__}.{cls.__qualname__}"


def test_family_names_are_unique_and_found_by_name() -> None:
    names = [family.name for family in FAMILIES]

    assert len(set(names)) == len(names)
    assert all(family_named(family.name) is family for family in FAMILIES)


def test_every_architecture_belongs_to_one_family() -> None:
    counts = Counter(name for family in FAMILIES for name in family.architectures)

    assert {1} == set(counts.values())
    assert tuple(counts) == SUPPORTED_ARCHITECTURES
    for family in FAMILIES:
        assert all(family_of(name) is family for name in family.architectures)
        assert set(family.biased_architectures) <= set(family.architectures)


def test_every_gguf_kind_belongs_to_one_family_and_converts_to_one_of_its_architectures() -> None:
    """A kind with experts and one without are two kinds (a `llama` file with experts is
    Mixtral's)."""
    owners = Counter(
        (kind.name, kind.has_experts) for family in FAMILIES for kind in family.gguf_kinds
    )

    assert {1} == set(owners.values())
    assert sorted({name for name, _ in owners}) == list(SUPPORTED_GGUF_KINDS)
    for family in FAMILIES:
        for kind in family.gguf_kinds:
            assert kind is gguf_kind(kind.name, kind.has_experts)
            assert kind.architecture in family.architectures
            assert bool(kind.expert_names) == kind.has_experts


def test_a_gguf_kind_without_its_expert_record_converts_by_the_other() -> None:
    """What the file's experts do not match falls back to the kind's first record."""
    assert "Qwen2ForCausalLM" == getattr(gguf_kind("qwen2", True), "architecture", None)
    assert "Qwen3MoeForCausalLM" == getattr(gguf_kind("qwen3moe", False), "architecture", None)
    assert gguf_kind("falcon", False) is None


def test_every_family_has_a_tiny_checkpoint_for_the_family_tests() -> None:
    """tests/model/test_families.py runs each family but Llama (the rest of the suite's)."""
    assert {family.name for family in FAMILIES} - {"llama"} == set(FAMILY_CONFIGS)
    for name, (_, architecture, _) in FAMILY_CONFIGS.items():
        assert family_of(architecture) is family_named(name)


def test_the_table_is_read_without_torch() -> None:
    """Processes that never run the model (the API server, the engine core) read
    architectures through model/arch.py."""
    code = (
        "import sys\n"
        "import otel_engine.model.arch, otel_engine.model.families\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert "False" == result.stdout.strip()
