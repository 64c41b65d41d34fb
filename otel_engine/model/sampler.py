"""Token sampling on the sampling rank: greedy, temperature, top-k, top-p, seeds.

Seeded rows draw their noise from a generator seeded by (seed, output position), so the
same seed gives the same tokens whatever else shares the batch or after a preemption.
Unseeded rows draw from one generator seeded by the engine seed (`--seed`), so an engine
restarted with the same seed and given the same requests in the same order samples the
same tokens.
"""

from __future__ import annotations

import torch

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


class Sampler:
    """Picks one token per row of logits [N, vocab] (float32)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # reseeded for every seeded row
        self.unseeded = torch.Generator(device=device)
        self.unseeded.manual_seed(seed & _MASK63)

    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: list[float],
        top_ps: list[float],
        top_ks: list[int],
        seeds: list[int | None],
        output_positions: list[int],
    ) -> list[int]:
        greedy = logits.max(dim=-1).indices  # the first maximum, like argmax, but faster
        if all(t == 0.0 for t in temperatures):
            return greedy.tolist()
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=self.device)
        logits = logits / temps.unsqueeze(1)
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = self._filter(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.unseeded)
        for row, seed in enumerate(seeds):
            if seed is not None:
                self.generator.manual_seed(((seed * _SEED_MIX) ^ output_positions[row]) & _MASK63)
                noise[row].exponential_(generator=self.generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        is_greedy = torch.tensor([t == 0.0 for t in temperatures], device=self.device)
        return torch.where(is_greedy, greedy, sampled).tolist()

    def _filter(self, logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        """Mask logits outside each row's top-k and top-p (nucleus) set."""
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=self.device).unsqueeze(0)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=self.device)
        drop = ranks >= ks.unsqueeze(1)
        ps = torch.tensor(top_ps, device=self.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before >= ps
        drop[:, 0] = False  # the most likely token survives any top_p, even one float32 rounds to 0
        sorted_logits.masked_fill_(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
