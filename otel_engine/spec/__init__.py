"""Speculative decoding: where proposals come from (ngram.py: prompt lookup; draft.py: a
draft model), how many each request verifies in a step (speculator.py, planned by cost.py
from measured step costs and each request's acceptance in state.py), and which are kept
(verify.py)."""
