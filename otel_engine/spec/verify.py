"""Which proposed tokens a step keeps.

The sampling rank samples every verified position as if it were an ordinary decode step:
row j's logits are the target model's given the request's tokens and the first j proposed
ones, processed (penalties, grammar mask, temperature, top-k/p) as they would be at that
output position, and a seeded row draws the noise of (seed, output position). So row j's
token is the one the target would sample there, as long as proposals 1..j were right. The
step keeps row 0's token, then each next row's while the proposal before it equals the
token sampled in its place: the output is exactly the target's (greedy and seeded output
token for token as without speculation; unseeded output from the same distribution), and
a proposal is accepted with the target's own probability of it.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(sampled: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """The tokens a verified request gains: `sampled` has one token per verified row
    (len(proposed) + 1); the first always, then one more for each leading proposal that
    equals the token sampled at its position."""
    kept = [sampled[0]]
    for position, token in enumerate(proposed):
        if sampled[position] != token:
            break
        kept.append(sampled[position + 1])
    return kept
