"""The decoder every family shares (Llama, Mistral, Qwen2 as they are; Qwen3, Phi-3 and the
mixtures of experts as small subclasses, model/families.py), tensor-parallel by heads.

Each rank holds its share of the attention heads (fused q/k/v rows) and of the MLP (fused
gate/up rows); the output projections are split by columns and summed with an all-reduce.
Embeddings and the LM head are replicated; only the sampling rank computes logits.

A layer's matrices are declared once (`projections.PROJECTIONS`); the fast-path plan
(`fast_paths.choose`, logged as `kernels.selected`) decides from the checkpoint's metadata,
before loading, the form of each (`matrix.py`: dense, prepacked for oneDNN, the 4-bit
kernels, or the file's GGUF blocks), whether the rest of each layer runs in the compiled
kernels (`layer_ops.KernelOps`) and whether a whole 4-bit model runs in one call
(`DecoderStack`). `kernels="torch"` keeps plain `F.linear` and torch ops, the reference the
tests compare the fast paths with. Loading only carries the plan out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from otel_engine.config import Int4Mode, KernelsMode, QuantActivations
from otel_engine.model import fast_paths, matrix
from otel_engine.model.arch import ModelArch
from otel_engine.model.attention import AttentionMetadata
from otel_engine.model.checkpoint import Checkpoint
from otel_engine.model.decoder_stack import DecoderStack
from otel_engine.model.fast_paths import Form, ModelShape, Path
from otel_engine.model.layer_ops import KernelOps, LayerOps, make_layer_ops
from otel_engine.model.layers import RotaryEmbedding, rms_norm
from otel_engine.model.limits import check_tensor_parallel
from otel_engine.model.matrix import Embedding, Matrix, MatrixKernels, Shard
from otel_engine.model.moe import MoeWeights, moe_forward, shard_experts
from otel_engine.model.projections import DOWN, GATE_UP, O_PROJ, PROJECTIONS, QKV, Projection
from otel_engine.model.quant import QuantWeight
from otel_engine.model.weights import QuantTensor

Staged = dict[str, torch.Tensor | QuantTensor]
Take = Callable[[str], torch.Tensor]


def _pop_dense(staged: Staged, prefix: str, key: str) -> torch.Tensor:
    """A staged tensor; one in GGUF blocks dequantized exactly (float32)."""
    return _dense(staged.pop(prefix + key))


def _dense(tensor: torch.Tensor | QuantTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantTensor) else tensor


class LlamaLayer:
    """One decoder layer's weights (this rank's shard)."""

    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.matrices: dict[Projection, Matrix] = {}
        # Qwen3: RMSNorm weights of each q and k head, applied before RoPE
        self.q_norm: torch.Tensor | None = None
        self.k_norm: torch.Tensor | None = None
        # a mixture of experts instead of the MLP's matrices
        self.moe: MoeWeights | None = None


class LlamaModel:
    """Weights as plain tensors and `Matrix` objects (no nn.Module: inference only).

    A family that stores its weights otherwise overrides `_dense_parts` (the parts of a
    projection, from `take(name)`, which pops the layer's HF-named tensor) or `_load_extras`
    (what a layer holds besides its norms and projections)."""

    layer_class: type[LlamaLayer] = LlamaLayer
    head_norm = staticmethod(rms_norm)  # of the q and k heads (Qwen3, Gemma 3)
    # why this family never runs the compiled kernels or prepacked weights (None: it may)
    kernels_blocker: str | None = None

    def __init__(
        self,
        arch: ModelArch,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        max_positions: int | None = None,
        kernels: KernelsMode = KernelsMode.AUTO,
        int4: Int4Mode = Int4Mode.AUTO,
        quant_activations: QuantActivations = QuantActivations.INT8,
        block_size: int = 16,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        check_tensor_parallel(arch, tp_size)
        self.arch, self.dtype, self.device = arch, dtype, device
        self.tp_size = tp_size
        self.shard = Shard(tp_rank, tp_size)
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
        self.norm: torch.Tensor
        self.embedding: Embedding
        self.lm_head: Matrix
        self.fast_paths = fast_paths.choose(
            kernels_flag=kernels,
            int4_flag=int4,
            quant_activations=quant_activations,
            device=device,
            dtype=dtype,
            shape=self._shape(),
            block_size=block_size,
            checkpoint=checkpoint,
        )
        self.ops: LayerOps = self._make_ops(max_positions)
        self._kernels: MatrixKernels | None = None  # built for the first quantized matrix
        self._stack: DecoderStack | None = None  # built on the first forward that can use it

    def _shape(self) -> ModelShape:
        arch = self.arch
        stack_blocker = None
        if arch.attention_bias or arch.qk_norm or arch.num_experts:
            stack_blocker = "the layers have biases, q/k norms or experts"
        return ModelShape(
            head_dim=self.head_dim,
            rotary_dim=self.rotary.dim,
            tp_size=self.tp_size,
            layers=tuple(self.projections(i) for i in range(arch.num_hidden_layers)),
            stack_blocker=stack_blocker,
            kernels_blocker=self.kernels_blocker,
        )

    def projections(self, index: int) -> tuple[Projection, ...]:
        """The matrices layer `index` loads (a layer with experts has no MLP matrices)."""
        dense = index in self.dense_layers
        return tuple(p for p in PROJECTIONS if dense or not p.in_mlp)

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

    @property
    def matrix_kernels(self) -> MatrixKernels:
        if self._kernels is None:
            self._kernels = MatrixKernels(self.fast_paths)
        return self._kernels

    # ---- loading -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Take HF-named full tensors and keep this rank's shard of each, in the form the plan
        chose for it."""
        staged: Staged = dict(weights)
        embed = staged.pop("model.embed_tokens.weight")
        lm_head = staged.pop("lm_head.weight", None)
        if lm_head is None or self.arch.tie_word_embeddings:
            lm_head = embed
        self.norm = self._norm_weight(_dense(staged.pop("model.norm.weight")))
        for index, layer in enumerate(self.layers):
            take = functools.partial(_pop_dense, staged, f"model.layers.{index}.")
            layer.input_norm = self._norm_weight(take("input_layernorm.weight"))
            layer.post_norm = self._norm_weight(take("post_attention_layernorm.weight"))
            for projection, form in self.fast_paths.forms[index].items():
                layer.matrices[projection] = self._load_matrix(
                    staged, take, index, projection, form
                )
            self._load_extras(take, layer, index)
        unused = [n for n in staged if "rotary_emb" not in n]
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
        self._load_embedding(embed, lm_head)

    def _load_matrix(
        self, staged: Staged, take: Take, index: int, projection: Projection, form: Form
    ) -> Matrix:
        bias = None
        if projection is QKV and self.arch.attention_bias:
            biases = [take(f"{source}.bias") for source in projection.sources]
            bias = self._place(torch.cat([self.shard.of(b, projection.split) for b in biases]))
        if form in (Form.DENSE, Form.PACKED):
            parts = self._dense_parts(take, projection)
            weight = torch.cat([self.shard.of(part, projection.split) for part in parts])
            return matrix.dense(form, self._place(weight), bias)
        blocks = [staged.pop(name) for name in projection.weight_names(index)]
        assert all(isinstance(b, QuantTensor) for b in blocks), "the plan saw blocks here"
        parts_q = [b for b in blocks if isinstance(b, QuantTensor)]
        return matrix.build(form, parts_q, projection.split, self.shard, self.matrix_kernels, bias)

    def _dense_parts(self, take: Take, projection: Projection) -> list[torch.Tensor]:
        """A projection's parts in row order, full size (not yet sharded)."""
        return [take(f"{source}.weight") for source in projection.sources]

    def _load_extras(self, take: Take, layer: LlamaLayer, index: int) -> None:
        if self.arch.qk_norm:
            layer.q_norm = self._norm_weight(take("self_attn.q_norm.weight"))
            layer.k_norm = self._norm_weight(take("self_attn.k_norm.weight"))

    def _load_embedding(
        self, embed: torch.Tensor | QuantTensor, lm_head: torch.Tensor | QuantTensor
    ) -> None:
        """The embedding and LM head in the forms the plan chose: their GGUF blocks where the
        layers run from theirs, else the model dtype."""
        plan = self.fast_paths
        if plan.embedding is Form.BLOCKS and isinstance(embed, QuantTensor):
            self.embedding = Embedding(None, embed, self.matrix_kernels)
        else:
            self.embedding = Embedding(self._place(_dense(embed)))
        if plan.lm_head is Form.BLOCKS and isinstance(lm_head, QuantTensor):
            blocks = QuantWeight((lm_head,), lm_head.rows, lm_head.cols)
            self.lm_head = matrix.BlockMatrix(blocks, self.matrix_kernels, None)
        elif lm_head is embed and self.embedding.weight is not None:
            self.lm_head = matrix.dense(plan.lm_head, self.embedding.weight, None)
        else:
            self.lm_head = matrix.dense(plan.lm_head, self._place(_dense(lm_head)), None)

    def _set_experts(
        self,
        layer: LlamaLayer,
        router: torch.Tensor,
        experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """A mixture of experts for `layer`, each expert split across the ranks like an MLP."""
        layer.moe = shard_experts(router, experts, self.shard.of, self._place, self.arch)

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm weight as the forward uses it."""
        return self._place(weight)

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def place_blocks(self) -> None:
        """Every GGUF block the model reads out of the file's mapping (`matrix.place_blocks`)."""
        matrix.place_blocks(self._matrices(), self.embedding)

    def _matrices(self) -> list[Matrix]:
        return [m for layer in self.layers for m in layer.matrices.values()] + [self.lm_head]

    # ---- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        eps, ops = self.arch.rms_norm_eps, self.ops
        hidden = self.embedding(input_ids)  # the residual stream, updated in place
        stack = self._decoder_stack(kv_caches)
        if stack is not None and stack.runs(hidden.shape[0], meta):
            return stack.forward(hidden, meta)
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            weights = layer.matrices
            x = ops.add_rms_norm(hidden, delta, layer.input_norm, eps)
            qkv = weights[QKV](x)
            if layer.q_norm is not None:
                self._norm_qk(qkv, layer)
            attn = ops.attend(qkv, k_cache, v_cache, meta)
            delta = self._all_reduce(weights[O_PROJ](attn))
            x = ops.add_rms_norm(hidden, delta, layer.post_norm, eps)
            if layer.moe is not None:
                delta = self._all_reduce(moe_forward(x, layer.moe, ops.silu_mul))
            else:
                delta = self._all_reduce(weights[DOWN](ops.silu_mul(weights[GATE_UP](x))))
        return ops.add_rms_norm(hidden, delta, self.norm, eps)

    def _decoder_stack(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> DecoderStack | None:
        """The compiled stack for these caches, where the plan runs it."""
        if self._stack is not None and self._stack.kv_caches is kv_caches:
            return self._stack
        if not self.fast_paths.is_on(Path.DECODER_STACK):
            return None
        assert isinstance(self.ops, KernelOps)
        self._stack = DecoderStack(self, self.ops, kv_caches)
        return self._stack

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

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's greedy token: the compiled argmax of the LM head's output in its own
        dtype (`compute_logits`'s, without the conversion: about 1 ms a step at 32 rows).
        None where the ops have no compiled argmax (or logits are post-processed: Gemma 3)."""
        argmax = self.ops.argmax
        if argmax is None:
            return None
        logits = self.lm_head(hidden)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        argmax(out=tokens, logits=logits, rows=logits.shape[0], vocab=logits.shape[1])
        return tokens.tolist()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x)
        return x
