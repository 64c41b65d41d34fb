"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, experts grouped by token.

The router picks `top_k` experts per token from the softmax of its logits (renormalized over
the chosen ones where the model says so, as HF transformers does); each expert then runs once
on exactly the tokens routed to it (their rows gathered, one matmul each), and its outputs,
scaled by the routing weights, are added back into their tokens' rows. No expert runs on a
token that was not routed to it. At TP > 1 every expert's MLP is split across the ranks like
a dense MLP (gate/up by rows, down by columns; the caller all-reduces): every rank holds a
slice of every expert (expert parallelism is not implemented).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from otel_engine.model.arch import ModelArch
from otel_engine.model.projections import Split


@dataclass(slots=True)
class MoeWeights:
    """One layer's experts (this rank's slice of each) and its router."""

    router: torch.Tensor  # [experts, hidden], replicated
    gate_up: torch.Tensor  # [experts, 2 * intermediate / tp, hidden]: gate rows, then up rows
    down: torch.Tensor  # [experts, hidden, intermediate / tp]
    top_k: int
    normalize: bool  # renormalize the top-k routing weights to sum to 1


def shard_experts(
    router: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor, Split], torch.Tensor],
    place: Callable[[torch.Tensor], torch.Tensor],
    arch: ModelArch,
) -> MoeWeights:
    """A layer's experts from each one's full (gate, up, down), this rank's slice of each:
    gate and up by rows, down by columns, as a dense MLP is split (`shard`)."""
    gate_up = [
        torch.cat([shard(gate, Split.ROWS), shard(up, Split.ROWS)]) for gate, up, _ in experts
    ]
    return MoeWeights(
        router=place(router),
        gate_up=place(torch.stack(gate_up)),
        down=place(torch.stack([shard(down, Split.COLUMNS) for _, _, down in experts])),
        top_k=arch.num_experts_per_tok,
        normalize=arch.norm_topk_prob,
    )


def route(x: torch.Tensor, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights ([tokens, top_k] each), as HF
    transformers computes them: softmax in float32, top-k, optional renormalization, then
    the weights in the model dtype."""
    logits = F.linear(x, moe.router)
    weights = torch.softmax(logits.float(), dim=-1)
    top_weights, experts = torch.topk(weights, moe.top_k, dim=-1)
    if moe.normalize:
        top_weights /= top_weights.sum(dim=-1, keepdim=True)
    return top_weights.to(x.dtype), experts


def moe_forward(
    x: torch.Tensor, moe: MoeWeights, silu_mul: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The layer's MLP output for `x` [tokens, hidden] (this rank's partial sum).

    The (token, expert) pairs are sorted by expert once; each expert then reads a contiguous
    slice of the gathered rows, and one `index_add_` puts every weighted result back."""
    weights, experts = route(x, moe)
    flat = experts.flatten()  # token t's choices at t * top_k ... t * top_k + top_k - 1
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=moe.router.shape[0]).tolist()
    tokens = order // moe.top_k
    rows = x.index_select(0, tokens)
    scales = weights.flatten().index_select(0, order).unsqueeze(1)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        hidden = silu_mul(F.linear(rows[start:end], moe.gate_up[expert]))
        torch.mul(F.linear(hidden, moe.down[expert]), scales[start:end], out=results[start:end])
        start = end
    return torch.zeros_like(x).index_add_(0, tokens, results)


def moe_forward_dense(
    x: torch.Tensor, moe: MoeWeights, silu_mul: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The same output, every expert run on every token and weighted by its routing weight
    (0 where not chosen): the naive loop, kept as the baseline of `bench/moe.py`."""
    weights, experts = route(x, moe)
    dense = torch.zeros(x.shape[0], moe.router.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for expert in range(moe.router.shape[0]):
        hidden = silu_mul(F.linear(x, moe.gate_up[expert]))
        out += F.linear(hidden, moe.down[expert]) * dense[:, expert : expert + 1]
    return out
