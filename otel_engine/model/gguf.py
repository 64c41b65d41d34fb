"""A .gguf file converted once into a Hugging Face checkpoint directory under the cache root
(`otel_engine.cache`): the header and metadata read, config.json written from them, the
tensors renamed to Hugging Face names and llama.cpp's q/k row permutation undone: the layer
matrices of the formats the kernels read (`weights.GgmlType`) kept in their blocks
(`weights.QUANT_FILE`), float tensors in the file's precision, other formats dequantized to
bfloat16.
The gguf package and torch are imported by the functions that need them."""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import time
from typing import TYPE_CHECKING, Any

from otel_engine.cache import cache_root
from otel_engine.memory import return_freed_memory
from otel_engine.model.arch import unique_ids
from otel_engine.model.families import SUPPORTED_GGUF_KINDS, GgufKind, gguf_kind
from otel_engine.model.weights import QUANT_FILE, GgmlType

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


CONVERTER_VERSION = 5  # 3: layer matrices kept in their GGUF blocks; 4: embedding, LM head;
# 5: float tensors (norms) in the file's precision, not bfloat16
# In the converted config.json: how many tensors were rounded to bfloat16 in the conversion.
ROUNDED_KEY = "otel_engine_gguf_tensors_in_bfloat16"


_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# Layer tensors by the names most kinds use (a kind's own: `GgufKind.layer_names`)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}


# What llama.cpp's Gemma 3 code assumes rather than reads (llama-model.cpp): a full-attention
# layer every 6th, a RoPE base of 10,000 on the sliding layers, and the attention scaled by
# hidden / heads for the 27B model (62 layers) and by head_dim for the others.
_GEMMA3_SLIDING_PATTERN = 6


_GEMMA3_LOCAL_ROPE_THETA = 10_000.0


_GEMMA3_27B_LAYERS = 62


_GGUF_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}


_GGUF_STRING, _GGUF_ARRAY, _GGUF_MIN_VERSION = 8, 9, 2


TensorEntry = tuple[str, tuple[int, ...], int, int]  # name, torch shape, ggml type, file offset


def cached_conversion(gguf_path: str) -> str:
    """Convert under an exclusive lock into a temp dir, then rename it into place atomically."""
    stat = os.stat(gguf_path)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(gguf_path).removesuffix(".gguf"))
    key = f"{stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERTER_VERSION}"
    root = cache_root()
    final = os.path.join(root, key)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(final, "config.json")):
            return final  # another process converted it while this one waited
        for stale in glob.glob(os.path.join(root, f".{key}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a conversion that was killed
        tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root)
        try:
            _convert_gguf(gguf_path, tmp)
            return_freed_memory()  # the conversion held the whole file
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.isfile(os.path.join(final, "config.json")):
                return final  # lost a race where flock does not exclude (some network mounts)
            raise
    return final


def _convert_gguf(gguf_path: str, out: str) -> None:
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    metadata, tensors = _read_gguf(gguf_path)
    kind = _gguf_kind(metadata)
    config = _hf_config(metadata, tensors, kind)
    num_experts = int(config.get("num_local_experts") or 0)
    weights, quant, formats, rounded = _gguf_weights(
        gguf_path, tensors, kind, config if kind.is_qk_permuted else None, num_experts
    )
    # The tensors of formats converted to bfloat16 here (not the file's own values in
    # float32): the start warns of them when the model runs in float32.
    config[ROUNDED_KEY] = rounded
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if quant:
        os.makedirs(os.path.dirname(os.path.join(out, QUANT_FILE)))
        described = {"format": "pt", "formats": json.dumps(formats)}
        save_file(quant, os.path.join(out, QUANT_FILE), metadata=described)
    del weights, quant
    eos = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": unique_ids(*eos)}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)
    directory, filename = os.path.split(gguf_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=filename)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out, save_jinja_files=False)  # chat template in tokenizer_config
    seconds = round(time.perf_counter() - started, 3)
    logger.info("model.gguf_converted", extra={"model_dir": out, "seconds": seconds})


def _read_gguf(path: str) -> tuple[dict[str, Any], list[TensorEntry]]:
    """The metadata and the tensor table of a GGUF v2/v3 file (no tensor data is read)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic, version, num_tensors, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF" or version < _GGUF_MIN_VERSION:
                raise ValueError("bad magic or version")
            pos, metadata = 24, {}
            for _ in range(num_kv):
                key, pos = _read_gguf_value(buf, pos, _GGUF_STRING)
                (value_type,) = struct.unpack_from("<I", buf, pos)
                metadata[key], pos = _read_gguf_value(buf, pos + 4, value_type)
            entries = []
            for _ in range(num_tensors):
                name, pos = _read_gguf_value(buf, pos, _GGUF_STRING)
                (num_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
                ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
                pos += 16 + 8 * num_dims
                entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    except (ValueError, struct.error, KeyError) as e:
        raise ValueError(f"{path} is not a readable GGUF v2/v3 file: {e}") from e
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    return metadata, [(name, shape, kind, start + offset) for name, shape, kind, offset in entries]


def _read_gguf_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type == _GGUF_STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8", "replace"), pos + 8 + length
    if value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        items = []
        for _ in range(count):
            item, pos = _read_gguf_value(buf, pos, item_type)
            items.append(item)
        return items, pos
    fmt = "<" + _GGUF_SCALARS[value_type]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _gguf_kind(metadata: dict[str, Any]) -> GgufKind:
    """The record the file converts by: its `general.architecture`, with experts or not."""
    arch = metadata.get("general.architecture")
    kind = gguf_kind(str(arch), bool(metadata.get(f"{arch}.expert_count")))
    if kind is None:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported ({list(SUPPORTED_GGUF_KINDS)})"
        )
    return kind


def _hf_config(
    metadata: dict[str, Any], tensors: list[TensorEntry], kind: GgufKind
) -> dict[str, Any]:
    arch = kind.name
    shapes = {name: shape for name, shape, _, _ in tensors}

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        return float(f"{value:.7g}") if isinstance(value, float) else value  # f32 1e-5 -> 1e-05

    hidden, heads = get("embedding_length"), get("attention.head_count")
    experts: dict[str, Any] = {}
    if get("expert_count"):
        experts = {
            "num_local_experts": get("expert_count"),
            "num_experts": get("expert_count"),
            "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "norm_topk_prob": True,
        }
    rope_scaling = None
    if get("rope.scaling.type") in ("linear", "yarn"):
        rope_scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor")}
        if original := get("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = original
    config = {
        "architectures": [kind.architecture],
        "model_type": kind.model_type,
        **{key: value for key, value in experts.items() if value is not None},
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "sliding_window": get("attention.sliding_window"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }
    if arch == "gemma3":
        config = _gemma3_gguf_config(config, get("attention.sliding_window_pattern"))
    return config


def _gemma3_gguf_config(config: dict[str, Any], pattern: Any) -> dict[str, Any]:
    """A Gemma 3 file's config in transformers' Gemma3TextConfig keys; `pattern` is the
    file's sliding-window pattern (an int, or a flag per layer, true for sliding), if any."""
    layers = config["num_hidden_layers"]
    if not config["sliding_window"]:
        raise ValueError("a gemma3 GGUF without gemma3.attention.sliding_window")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"a gemma3 GGUF with {len(pattern)} sliding-window flags for {layers} layers"
            )
        sliding = [bool(flag) for flag in pattern]
    else:
        every = int(pattern or _GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    scaling = config.pop("rope_scaling") or {}
    if scaling.get("rope_type", "linear") != "linear":
        raise ValueError(
            f"a gemma3 GGUF with {scaling['rope_type']!r} RoPE scaling is not supported"
        )
    full = {"rope_type": "linear" if scaling else "default", "rope_theta": config.pop("rope_theta")}
    if scaling:
        full["factor"] = scaling["factor"]
    head_dim = config["head_dim"]
    if layers == _GEMMA3_27B_LAYERS:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = head_dim
    return {
        **config,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _expert_names(name: str, kind: GgufKind, num_experts: int) -> list[str] | None:
    """The per-expert HF names of a GGUF expert tensor (one for a router), or None."""
    stem, _, suffix = name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    table = kind.expert_names
    if not layer or layer[2] not in table:
        return None
    pattern = f"model.layers.{layer[1]}.{table[layer[2]]}.{suffix}"
    if "{e}" not in pattern:
        return [pattern]
    return [pattern.format(e=e) for e in range(num_experts)]


def _hf_tensor_name(name: str, kind: GgufKind) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{suffix}"
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    names = {**_GGUF_LAYER_NAMES, **kind.layer_names}
    if layer and layer[2] in names:
        return f"model.layers.{layer[1]}.{names[layer[2]]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {name!r} of this {kind.name!r} file has no Hugging Face equivalent in this "
        "converter (experts: a mixture of experts; rope_freqs, rope_factors: RoPE scaling): "
        "use the model's Hugging Face checkpoint instead"
    )


# The Hugging Face matrices kept in their GGUF blocks when stored in a `GgmlType` format:
# the layers' projections, the embedding and the LM head
_QUANT_MATRIX = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight|model\.embed_tokens\.weight"
    r"|lm_head\.weight"
)


def _gguf_weights(
    path: str,
    tensors: list[TensorEntry],
    kind: GgufKind,
    permute_config: dict[str, Any] | None,
    num_experts: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, tuple[str, int]], int]:
    """Tensors with HF names, q/k rows back in HF order if permuted: F32, F16 and BF16 tensors
    as the file stores them, other formats dequantized to bfloat16, except matrices in a
    `GgmlType` format, kept in their blocks (uint8 [rows, row bytes]) with their format and
    width (`weights.iter_quant` reads them back); and how many file tensors were rounded to
    bfloat16."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    float_types = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights, quant, formats = {}, {}, {}
    rounded = 0
    for name, shape, ggml_type, offset in tensors:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, row_bytes = math.prod(shape[:-1]), shape[-1] // block_size * block_bytes
        raw = data[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
        expert_names = _expert_names(name, kind, shape[0]) if num_experts else None
        if expert_names is not None:  # experts: one HF tensor each, dequantized
            rounded += qtype.name != "BF16"
            stacked = torch.from_numpy(dequantize(raw, qtype).copy()).reshape(shape)
            stacked = stacked.to(torch.bfloat16)
            if len(expert_names) == 1:
                weights[expert_names[0]] = stacked.contiguous()
            else:
                for index, expert_name in enumerate(expert_names):
                    weights[expert_name] = stacked[index].contiguous()
            continue
        hf_name = _hf_tensor_name(name, kind)
        keep = qtype.name in GgmlType.__members__ and bool(_QUANT_MATRIX.fullmatch(hf_name))
        if keep:
            tensor = torch.from_numpy(np.array(raw))  # rows of blocks: permuted like weights
        else:
            values = dequantize(raw, qtype)
            tensor = torch.from_numpy(values if values.flags.writeable else values.copy())
            tensor = tensor.reshape(shape)
        if permute_config is not None and ".q_proj." in hf_name:
            tensor = _unpermute_rows(tensor, permute_config["num_attention_heads"])
        elif permute_config is not None and ".k_proj." in hf_name:
            tensor = _unpermute_rows(tensor, permute_config["num_key_value_heads"])
        if keep:
            quant[hf_name] = tensor.contiguous()
            formats[hf_name] = (qtype.name, shape[-1])
            continue
        if kind.has_norms_plus_one and hf_name.endswith("norm.weight"):
            tensor = tensor - 1.0
        # A float tensor keeps the file's precision, so float32 runs on the file's values;
        # a format dequantized here (not one the kernels read) is stored in bfloat16.
        stored = float_types.get(qtype.name, torch.bfloat16)
        rounded += stored == torch.bfloat16 and qtype.name != "BF16"
        weights[hf_name] = tensor.to(stored).contiguous()
    return weights, quant, formats, rounded


def _unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary rows (convert_hf_to_gguf `permute`)."""
    shape = tensor.shape
    split = tensor.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
    return split.transpose(1, 2).reshape(shape)
