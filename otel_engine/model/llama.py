"""The decoder every family shares (Llama, Mistral, Qwen2 as they are; Qwen3, Phi-3 and the
mixtures of experts as small subclasses, model/registry.py), in plain torch, tensor-parallel
by heads.

Each rank holds its share of the attention heads (fused q/k/v rows) and of the MLP
(fused gate/up rows); the output projections are split by columns and summed with an
all-reduce. Embeddings and the LM head are replicated; only the sampling rank computes
logits.

With `kernels="auto"` on CPU the fast paths that this CPU and torch can run are chosen once
(`fast_paths.choose`, logged as `kernels.selected`): weights prepacked for oneDNN where
oneDNN runs them, and the rest of each layer in the compiled kernels (`layer_ops.KernelOps`);
`kernels="torch"` keeps plain `F.linear` and torch ops, the reference that the tests compare
the fast path with. A checkpoint stored in 4 bits (a GGUF Q4_0/Q4_1, the default model)
multiplies by its own 4-bit weights instead where the kernels are built for AVX-512 BF16
(`load_int4`), and its bfloat16 copies are dropped: steps of at most `INT4_MAX_ROWS` tokens
in `q4_linear_bf16` (cpu_kernels.c; the exact 4-bit weights, 4x fewer bytes to read than
bfloat16, and a decode step of a few sequences is bound by reading them), larger ones in
`panel_linear_bf16` (the same weights dequantized once at load into bfloat16 panels that it
streams ahead of use: 24% faster than oneDNN at 32 rows without AMX), or where torch's matmul
runs on AMX, in tiles of the file's blocks dequantized for it (no panels). A model that is
all 4-bit on one rank runs its whole decoder stack in one call (`decoder_stack_bf16`,
`DecoderStack`) for the steps the stack takes. A GGUF file's matrices in the other formats
the kernels read (Q8_0, Q4_K, Q5_K, Q6_K, and Q4_0/Q4_1 where the 4-bit kernels are off),
and then its embedding and LM head, are multiplied from their blocks (`quant_kernels`:
model/quant.py) and never copied to bfloat16; after load every block is copied out of the
file's mapping onto 2 MiB pages (`place_blocks`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from otel_engine.memory import huge_page_copies
from otel_engine.model import fast_paths
from otel_engine.model.arch import ModelArch
from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.decoder_stack import DecoderStack
from otel_engine.model.int4 import INT4_KERNELS_MAX_BYTES, INT4_MAX_ROWS, Int4Weight, pack_int4
from otel_engine.model.layer_ops import KernelOps, LayerOps, make_layer_ops
from otel_engine.model.layers import RotaryEmbedding, rms_norm
from otel_engine.model.limits import check_tensor_parallel
from otel_engine.model.moe import MoeWeights, moe_forward
from otel_engine.model.quant import QuantLinear, QuantWeight, pack_quant, shard_columns
from otel_engine.model.weights import INT4_GROUP, INT4_TYPES, Int4Tensor, QuantTensor

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


# a layer's four matrices (attribute names), each with a 4-bit (`name4`) and a GGUF-block
# (`name_q`) form
_MATRICES = ("qkv", "o_proj", "gate_up", "down")


# what a layer keeps of its bfloat16 matrices once their 4-bit form is in use
_DROPPED = torch.empty(0)


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


Staged = dict[str, torch.Tensor | QuantTensor]


def _pop_prefixed(staged: Staged, prefix: str, key: str) -> torch.Tensor:
    """The tensor, a matrix in GGUF blocks dequantized to bfloat16 (what the families that
    load their own matrices take)."""
    return _dense(staged.pop(prefix + key))


def _dense(tensor: torch.Tensor | QuantTensor) -> torch.Tensor:
    if isinstance(tensor, QuantTensor):
        return tensor.dequantize().to(torch.bfloat16)
    return tensor


class LlamaLayer:
    """One decoder layer's weights (this rank's shard) and forward."""

    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.qkv: torch.Tensor
        self.qkv_bias: torch.Tensor | None = None
        self.o_proj: torch.Tensor
        self.gate_up: torch.Tensor
        self.down: torch.Tensor
        # the same matrices in 4 bits, when the checkpoint has them (`load_int4`)
        self.qkv4: Int4Weight | None = None
        self.o_proj4: Int4Weight | None = None
        self.gate_up4: Int4Weight | None = None
        self.down4: Int4Weight | None = None
        # or multiplied from their GGUF blocks (`quant_kernels`)
        self.qkv_q: QuantWeight | None = None
        self.o_proj_q: QuantWeight | None = None
        self.gate_up_q: QuantWeight | None = None
        self.down_q: QuantWeight | None = None
        # Qwen3: RMSNorm weights of each q and k head, applied before RoPE
        self.q_norm: torch.Tensor | None = None
        self.k_norm: torch.Tensor | None = None
        # a mixture of experts instead of the dense MLP (gate_up and down then unused)
        self.moe: MoeWeights | None = None


class LlamaModel:
    """Weights as plain tensors (no nn.Module: inference only, no autograd state).

    A family that stores its weights otherwise overrides `_load_attention` / `_load_mlp`
    (they receive `take(name)`, which pops the layer's HF-named tensor); q/k norms and
    mixtures of experts run here when a layer has them."""

    layer_class: type[LlamaLayer] = LlamaLayer
    head_norm = staticmethod(rms_norm)  # of the q and k heads (Qwen3, Gemma 3)

    def __init__(
        self,
        arch: ModelArch,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        max_positions: int | None = None,
        kernels: str = "auto",
        int4: str = "auto",
        quant_activations: str = "int8",
        block_size: int = 16,
    ) -> None:
        check_tensor_parallel(arch, tp_size)
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.head_dim = arch.head_dim
        self.num_heads = arch.num_attention_heads // tp_size
        self.num_kv_heads = arch.num_key_value_heads // tp_size
        self.intermediate = arch.intermediate_size // tp_size
        self.dense_layers = (
            set(arch.dense_layers) if arch.num_experts else set(range(arch.num_hidden_layers))
        )
        self.layers = [self.layer_class() for _ in range(arch.num_hidden_layers)]
        self.rotary = RotaryEmbedding(
            int(self.head_dim * arch.partial_rotary_factor),
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            dtype,
            device,
        )
        self.embed: torch.Tensor
        self.norm: torch.Tensor
        self.lm_head: torch.Tensor
        # the embedding and the LM head in their GGUF blocks where `quant_kernels` runs the
        # layers from theirs (else None: `embed` and `lm_head` are the bfloat16 matrices)
        self.embed_q: QuantTensor | None = None
        self.lm_head_q: QuantWeight | None = None
        self.fast_paths = fast_paths.choose(
            kernels_flag=kernels,
            int4_flag=int4,
            quant_activations=quant_activations,
            device=device,
            dtype=dtype,
            head_dim=self.head_dim,
            rotary_dim=self.rotary.dim,
            block_size=block_size,
            tp_size=tp_size,
            blocker=self.kernels_blocker,
        )
        self.ops: LayerOps = self._make_ops(max_positions)
        self.is_packed = self.fast_paths.is_on("onednn_packing")
        self.linear: Linear = _packed_linear if self.is_packed else F.linear
        self._int4_scratch = torch.empty(0)  # the 4-bit kernel's sums of x per group
        self._stack: DecoderStack | None = None  # built on the first forward that can use it
        self._quant: QuantLinear | None = None
        self._int4_tiles: QuantLinear | None = None  # larger steps of 4-bit matrices (AMX)
        if self.fast_paths.is_on("quant_kernels"):
            assert isinstance(self.ops, KernelOps)
            assert self.ops.quant_linear is not None
            assert self.ops.gguf_dequantize is not None
            self._quant = QuantLinear(
                self.ops.quant_linear, self.ops.gguf_dequantize, self.ops.quant_linear_amx
            )

    # why this family never runs the compiled kernels or prepacked weights (None: it may)
    kernels_blocker: str | None = None

    def _make_ops(self, max_positions: int | None) -> LayerOps:
        return make_layer_ops(
            self.fast_paths,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rotary=self.rotary,
            dtype=self.dtype,
            device=self.device,
        )

    # ---- loading -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Take HF-named full tensors, keep this rank's shard in the target dtype; matrices
        in GGUF blocks kept in them where `quant_kernels` runs them, else dequantized."""
        staged: Staged = {}
        for name, tensor in weights:
            staged[name] = tensor
        embed = staged.pop("model.embed_tokens.weight")
        self.norm = self._norm_weight(_dense(staged.pop("model.norm.weight")))
        lm_head = staged.pop("lm_head.weight", None)
        if lm_head is None or self.arch.tie_word_embeddings:
            lm_head = embed
        self._leave_4_bits_to_blocks(staged)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            take = functools.partial(_pop_prefixed, staged, prefix)
            layer.input_norm = self._norm_weight(take("input_layernorm.weight"))
            layer.post_norm = self._norm_weight(take("post_attention_layernorm.weight"))
            if self._quant is not None:
                self._load_quant(staged, prefix, layer, i)
            self._load_attention(take, layer)
            self._load_mlp(take, layer, i)
        unused = [n for n in staged if "rotary_emb" not in n]
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
        if self._quant is not None and not self._has_quant():
            self.fast_paths.decide(
                "quant_kernels",
                False,
                "no matrix in GGUF blocks that the 4-bit kernels do not take",
            )
            self._quant = None
        self._load_embedding(embed, lm_head)
        if self.is_packed:
            self._pack_weights()

    def _load_embedding(
        self, embed: torch.Tensor | QuantTensor, lm_head: torch.Tensor | QuantTensor
    ) -> None:
        """The embedding and LM head: in their GGUF blocks where the layers run from theirs
        (`quant_kernels` on: a lookup dequantizes its rows, the LM head runs as a layer matrix
        does), else bfloat16. A model whose layers the 4-bit kernels take (the default model)
        keeps them bfloat16: its LM head at 32 rows is faster prepacked than tiled."""
        if self._quant is not None and isinstance(embed, QuantTensor):
            self.embed_q, self.embed = embed, _DROPPED
        else:
            self.embed = self._place(_dense(embed))
        if lm_head is embed and self.embed_q is None:
            self.lm_head = self.embed
        elif self._quant is not None and isinstance(lm_head, QuantTensor):
            self.lm_head_q = QuantWeight((lm_head,), lm_head.rows, lm_head.cols)
            self.lm_head = _DROPPED
        else:
            self.lm_head = self._place(_dense(lm_head))

    # The matrices `_load_quant` may keep in their blocks: attribute -> (HF names, column split)
    _QUANT_MATRICES = (
        ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), False),
        ("o_proj", ("self_attn.o_proj",), True),
        ("gate_up", ("mlp.gate_proj", "mlp.up_proj"), False),
        ("down", ("mlp.down_proj",), True),
    )

    def _load_quant(self, staged: Staged, prefix: str, layer: LlamaLayer, index: int) -> None:
        """Keep this layer's matrices that are all in GGUF blocks in them (this rank's shard),
        leaving the rest for the dense loaders: not Q4_0/Q4_1 alone where the 4-bit kernels
        take those, nor a dense layer's MLP where a family loads its experts instead."""
        int4 = self.fast_paths.is_on("int4_kernels")
        for attribute, names, by_columns in self._QUANT_MATRICES:
            if attribute in ("gate_up", "down") and index not in self.dense_layers:
                continue
            keys = [f"{prefix}{name}.weight" for name in names]
            parts = [staged.get(key) for key in keys]
            if not all(isinstance(part, QuantTensor) for part in parts):
                continue
            tensors = [part for part in parts if isinstance(part, QuantTensor)]
            if int4 and all(part.kind in INT4_TYPES for part in tensors):
                continue
            shards = [self._quant_shard(part, by_columns) for part in tensors]
            packed = pack_quant([s for s in shards if s is not None])
            if packed is None or any(s is None for s in shards):
                continue
            for key in keys:
                del staged[key]
            setattr(layer, f"{attribute}_q", packed)
            setattr(layer, attribute, _DROPPED)

    def _leave_4_bits_to_blocks(self, staged: Staged) -> None:
        """With x in 8 bits (`quant_activations` int8), a model whose Q4_0/Q4_1 layer matrices
        are more than `INT4_KERNELS_MAX_BYTES` runs them from their blocks like every other
        format, not in the 4-bit kernels' own layout (beside the blocks, 0.75 bytes a weight;
        without AMX also bfloat16 panels, 2 more): `int4_kernels` off."""
        plan = self.fast_paths
        if (
            self._quant is None
            or plan.quant_activations != "int8"
            or not plan.is_on("int4_kernels")
        ):
            return
        size = sum(
            t.raw.numel()
            for name, t in staged.items()
            if isinstance(t, QuantTensor)
            and t.kind in INT4_TYPES
            and name.startswith("model.layers.")
        )
        if size > INT4_KERNELS_MAX_BYTES:
            plan.decide(
                "int4_kernels",
                False,
                f"{size >> 20} MiB of Q4_0/Q4_1 layers (over {INT4_KERNELS_MAX_BYTES >> 20}): "
                "from their blocks with x in 8 bits",
            )

    def _quant_shard(self, tensor: QuantTensor, by_columns: bool) -> QuantTensor | None:
        if by_columns:
            return shard_columns(tensor, self.tp_rank, self.tp_size)
        size = tensor.rows // self.tp_size
        rows = tensor.raw[self.tp_rank * size : (self.tp_rank + 1) * size]
        return QuantTensor(rows, tensor.kind, tensor.cols)

    def _has_quant(self) -> bool:
        return any(
            getattr(layer, f"{name}_q") is not None for layer in self.layers for name in _MATRICES
        )

    def _load_attention(self, take: Callable[[str], torch.Tensor], layer: LlamaLayer) -> None:
        if layer.qkv_q is None:
            q, k, v = (take(f"self_attn.{p}_proj.weight") for p in "qkv")
            self._set_qkv(layer, q, k, v)
        if self.arch.attention_bias:
            qb, kb, vb = (take(f"self_attn.{p}_proj.bias") for p in "qkv")
            layer.qkv_bias = self._place(
                torch.cat([self._rows(qb), self._rows(kb), self._rows(vb)])
            )
        if layer.o_proj_q is None:
            layer.o_proj = self._place(self._cols(take("self_attn.o_proj.weight")))
        if self.arch.qk_norm:
            layer.q_norm = self._norm_weight(take("self_attn.q_norm.weight"))
            layer.k_norm = self._norm_weight(take("self_attn.k_norm.weight"))

    def _set_qkv(
        self, layer: LlamaLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """This rank's heads of q, k and v, fused in that order."""
        layer.qkv = self._place(torch.cat([self._rows(q), self._rows(k), self._rows(v)]))

    def _load_mlp(self, take: Callable[[str], torch.Tensor], layer: LlamaLayer, index: int) -> None:
        if layer.gate_up_q is None:
            self._set_gate_up(layer, take("mlp.gate_proj.weight"), take("mlp.up_proj.weight"))
        if layer.down_q is None:
            layer.down = self._place(self._cols(take("mlp.down_proj.weight")))

    def _set_gate_up(self, layer: LlamaLayer, gate: torch.Tensor, up: torch.Tensor) -> None:
        """This rank's rows of the gate and up projections, fused in that order."""
        layer.gate_up = self._place(torch.cat([self._rows(gate), self._rows(up)]))

    def _set_experts(
        self,
        layer: LlamaLayer,
        router: torch.Tensor,
        experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """A mixture of experts for `layer`: the router, and each expert's (gate, up, down)
        split across the ranks like a dense MLP."""
        gate_up = [torch.cat([self._rows(gate), self._rows(up)]) for gate, up, _ in experts]
        layer.moe = MoeWeights(
            router=self._place(router),
            gate_up=self._place(torch.stack(gate_up)),
            down=self._place(torch.stack([self._cols(down) for _, _, down in experts])),
            top_k=self.arch.num_experts_per_tok,
            normalize=self.arch.norm_topk_prob,
        )

    def _pack_weights(self) -> None:
        """Reorder every matmul weight for oneDNN; the embedding stays plain (a tied LM
        head gets its own packed copy)."""
        if self.lm_head_q is None:
            self.lm_head = _pack(self.lm_head)
        for layer in self.layers:
            dense = ("qkv", "o_proj") if layer.moe is not None else _MATRICES
            for name in dense:
                if getattr(layer, f"{name}_q") is None:  # else kept in GGUF blocks
                    setattr(layer, name, _pack(getattr(layer, name)))

    def _rows(self, weight: torch.Tensor) -> torch.Tensor:
        size = weight.shape[0] // self.tp_size
        return weight[self.tp_rank * size : (self.tp_rank + 1) * size]

    def _cols(self, weight: torch.Tensor) -> torch.Tensor:
        size = weight.shape[1] // self.tp_size
        return weight[:, self.tp_rank * size : (self.tp_rank + 1) * size]

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm weight as the forward uses it."""
        return self._place(weight)

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    # ---- forward -------------------------------------------------------------------------

    def load_int4(self, weights: dict[str, Int4Tensor]) -> None:
        """Multiply by the checkpoint's 4-bit tensors (this rank's shard of every layer's
        matrices) and drop their bfloat16 copies, where the fast paths allow it; records
        the outcome (`int4_kernels`, `decoder_stack`) in `fast_paths`. Changes nothing when
        some matrix has no 4-bit form or its shard does not fit."""
        plan = self.fast_paths
        if plan.is_on("int4_kernels"):
            reason = self._load_int4(weights) if weights else "the checkpoint has no 4-bit weights"
            plan.decide("int4_kernels", reason is None, reason or "the checkpoint's 4-bit weights")
        if plan.is_on("decoder_stack"):
            reason = self._stack_blocker()
            plan.decide("decoder_stack", reason is None, reason or "every layer in 4 bits")

    def _load_int4(self, weights: dict[str, Int4Tensor]) -> str | None:
        ops = self.ops
        build_panels = ops.q4_build_panels
        if ops.q4_linear is None or build_panels is None or ops.panel_linear is None:
            return "the kernels library has no 4-bit matmuls"
        if self.fast_paths.int4_tiles:
            assert ops.quant_linear is not None
            assert ops.gguf_dequantize is not None
            self._int4_tiles = QuantLinear(
                ops.quant_linear, ops.gguf_dequantize, ops.quant_linear_amx
            )
        fused = {
            "qkv4": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), self._rows),
            "o_proj4": (("self_attn.o_proj",), self._cols),
            "gate_up4": (("mlp.gate_proj", "mlp.up_proj"), self._rows),
            "down4": (("mlp.down_proj",), self._cols),
        }
        built: list[dict[str, Int4Weight]] = []
        for i in range(len(self.layers)):
            prefix = f"model.layers.{i}."
            layer: dict[str, Int4Weight] = {}
            for attribute, (names, shard) in fused.items():
                if getattr(self.layers[i], attribute.removesuffix("4") + "_q") is not None:
                    continue  # multiplied from its GGUF blocks
                parts = [weights.get(prefix + name) for name in names]
                if any(part is None for part in parts):
                    return f"{prefix}{names[0]} is not stored in 4 bits"
                fours = [p for p in parts if p is not None]
                blocks = self._int4_blocks(fours, by_columns=shard == self._cols)
                if blocks is not None:
                    weight = pack_int4(fours, shard, None, blocks)
                else:
                    weight = pack_int4(fours, shard, build_panels)
                if weight is None:
                    return f"{prefix}{names[0]}: this shard does not fit the 4-bit kernel"
                layer[attribute] = weight
            built.append(layer)
        for layer_weights, target in zip(built, self.layers, strict=True):
            for attribute, weight in layer_weights.items():
                setattr(target, attribute, weight)
                setattr(target, attribute.removesuffix("4"), _DROPPED)
        return None

    def place_blocks(self) -> None:
        """Copy every matrix kept in its GGUF blocks (layers, embedding, LM head, 4-bit tiles'
        sources) out of the checkpoint file's mapping into one region of 2 MiB pages
        (`memory.huge_page_copies`), dropping the mapping: a token reads them all, and from
        the page cache's 4 KiB pages that ran at two thirds of the speed (Llama-3.1-8B
        Q4_K_M: 504 ms a token). The resident bytes stay the blocks' own: once unmapped, the
        file's pages no longer count."""
        matrices: list[tuple[LlamaLayer, str]] = []  # layer attributes holding QuantWeights
        fours: list[tuple[LlamaLayer, str]] = []  # and Int4Weights with blocks for their tiles
        for layer in self.layers:
            for name in _MATRICES:
                if getattr(layer, f"{name}_q") is not None:
                    matrices.append((layer, f"{name}_q"))
                int4 = getattr(layer, f"{name}4")
                if int4 is not None and int4.blocks is not None:
                    fours.append((layer, f"{name}4"))
        weights = [getattr(layer, name) for layer, name in matrices]
        weights += [getattr(layer, name).blocks for layer, name in fours]
        weights += [self.lm_head_q] if self.lm_head_q is not None else []
        tensors = [self.embed_q] if self.embed_q is not None else []
        tensors += [part for weight in weights for part in weight.parts]
        if not tensors:
            return
        copies = huge_page_copies([t.raw for t in tensors], "the model's GGUF blocks")
        placed = {
            id(tensor): QuantTensor(copy, tensor.kind, tensor.cols)
            for tensor, copy in zip(tensors, copies, strict=True)
        }

        def moved(weight: QuantWeight) -> QuantWeight:
            return dataclasses.replace(weight, parts=tuple(placed[id(p)] for p in weight.parts))

        if self.embed_q is not None:
            self.embed_q = placed[id(self.embed_q)]
        if self.lm_head_q is not None:
            self.lm_head_q = moved(self.lm_head_q)
        for layer, name in matrices:
            setattr(layer, name, moved(getattr(layer, name)))
        for layer, name in fours:
            int4 = getattr(layer, name)
            setattr(layer, name, dataclasses.replace(int4, blocks=moved(int4.blocks)))

    def _int4_blocks(self, parts: list[Int4Tensor], *, by_columns: bool) -> QuantWeight | None:
        """This rank's shard of the parts' blocks, for larger steps in tiles where the fast
        paths chose them (None: panels instead, as also where the shard splits blocks)."""
        sources = [part.blocks for part in parts]
        if self._int4_tiles is None or any(source is None for source in sources):
            return None
        shards = [self._quant_shard(s, by_columns) for s in sources if s is not None]
        if any(s is None for s in shards):
            return None
        return pack_quant([s for s in shards if s is not None])

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        eps = self.arch.rms_norm_eps
        ops, linear = self.ops, self._linear
        hidden = self._embed(input_ids)  # the residual stream, updated in place
        stack = self._decoder_stack(kv_caches)
        if stack is not None and stack.runs(hidden.shape[0], meta):
            return stack.forward(hidden, meta)
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = ops.add_rms_norm(hidden, delta, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv4 or layer.qkv_q, layer.qkv_bias)
            if layer.q_norm is not None:
                self._norm_qk(qkv, layer)
            attn = ops.attend(qkv, k_cache, v_cache, meta)
            delta = self._all_reduce(linear(attn, layer.o_proj, layer.o_proj4 or layer.o_proj_q))
            x = ops.add_rms_norm(hidden, delta, layer.post_norm, eps)
            if layer.moe is not None:
                delta = self._all_reduce(moe_forward(x, layer.moe, ops.silu_mul))
            else:
                act = ops.silu_mul(linear(x, layer.gate_up, layer.gate_up4 or layer.gate_up_q))
                delta = self._all_reduce(linear(act, layer.down, layer.down4 or layer.down_q))
        return ops.add_rms_norm(hidden, delta, self.norm, eps)

    def _decoder_stack(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> DecoderStack | None:
        """The compiled stack for these caches, where this model is what it runs: one rank,
        every layer's four matrices in 4 bits, no biases, q/k norms or experts."""
        if self._stack is not None and self._stack.kv_caches is kv_caches:
            return self._stack
        if not self.fast_paths.is_on("decoder_stack"):
            return None
        assert isinstance(self.ops, KernelOps)
        self._stack = DecoderStack(self, self.ops, kv_caches)
        return self._stack

    def _stack_blocker(self) -> str | None:
        """Why the compiled stack cannot run this model (None: it can): it runs one rank's
        layers whose four matrices are all 4-bit, without biases, q/k norms or experts."""
        ops = self.ops
        if not isinstance(ops, KernelOps) or ops.decoder_stack is None or self.tp_size != 1:
            return "needs the kernels' decoder stack and one rank"
        for i, layer in enumerate(self.layers):
            weights = (layer.qkv4, layer.o_proj4, layer.gate_up4, layer.down4)
            if any(w is None for w in weights):
                return f"layer {i} is not all 4-bit"
            if layer.qkv_bias is not None or layer.q_norm is not None or layer.moe is not None:
                return f"layer {i} has biases, q/k norms or experts"
        return None

    def _norm_qk(self, qkv: torch.Tensor, layer: LlamaLayer) -> None:
        """RMSNorm each q and k head of `qkv` in place (Qwen3), before `attend` rotates them."""
        assert layer.q_norm is not None
        assert layer.k_norm is not None
        eps, head_dim = self.arch.rms_norm_eps, self.head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        q = qkv[:, :q_size].view(-1, self.num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, head_dim)
        q.copy_(self.head_norm(q, layer.q_norm, eps))
        k.copy_(self.head_norm(k, layer.k_norm, eps))

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        stored: Int4Weight | QuantWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ W.T (+ bias), W as the checkpoint stored it where a fast path keeps it so
        (`stored`: its 4-bit form or its GGUF blocks), else `weight`."""
        if stored is None:
            return self.linear(x, weight, bias)
        x = x.contiguous()
        if isinstance(stored, QuantWeight):
            assert self._quant is not None
            out = self._quant(x, stored)
            return out if bias is None else out.add_(bias)
        rows, ops, int4 = x.shape[0], self.ops, stored
        out = torch.empty((rows, int4.rows), dtype=x.dtype)
        pointers = (out.data_ptr(), x.data_ptr(), int4.packed.data_ptr(), int4.params.data_ptr())
        if rows > INT4_MAX_ROWS and int4.panels is not None:
            assert ops.panel_linear is not None
            ops.panel_linear(*pointers[:2], int4.panels.data_ptr(), rows, int4.rows, int4.cols)
        elif rows > INT4_MAX_ROWS:  # tiles of the blocks instead of panels
            assert self._int4_tiles is not None
            assert int4.blocks is not None
            out = self._int4_tiles.larger(x, int4.blocks, out)
        else:
            need = rows * (int4.cols // INT4_GROUP)
            if self._int4_scratch.numel() < need:
                self._int4_scratch = torch.empty(need, dtype=torch.float32)
            assert ops.q4_linear is not None
            ops.q4_linear(*pointers, self._int4_scratch.data_ptr(), rows, int4.rows, int4.cols)
        return out if bias is None else out.add_(bias)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden).float()

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's output in the model's dtype."""
        if self.lm_head_q is not None:
            assert self._quant is not None
            return self._quant(hidden.contiguous(), self.lm_head_q)
        return self.linear(hidden, self.lm_head, None)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows (a new tensor), from the blocks where kept in them."""
        if self.embed_q is None:
            return F.embedding(input_ids, self.embed)
        assert self.ops.gguf_dequantize is not None
        blocks = self.embed_q.raw.index_select(0, input_ids.to(self.embed_q.raw.device))
        out = torch.empty((blocks.shape[0], self.embed_q.cols), dtype=torch.bfloat16)
        self.ops.gguf_dequantize(
            out.data_ptr(), blocks.data_ptr(), self.embed_q.type_id, blocks.shape[0], out.shape[1]
        )
        return out

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's greedy token straight from the LM head's output in its own dtype: the
        argmax of `compute_logits` (converting to float32 is exact), without the conversion
        or torch's reduction (32 rows of the default model: about 1 ms a step). None where
        the ops have no compiled argmax (or logits are post-processed: Gemma 3)."""
        argmax = self.ops.argmax
        if argmax is None:
            return None
        logits = self._lm_head(hidden)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        argmax(tokens.data_ptr(), logits.data_ptr(), logits.shape[0], logits.shape[1])
        return tokens.tolist()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x)
        return x
