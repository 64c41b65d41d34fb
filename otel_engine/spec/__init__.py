"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), how many tokens
each request may propose (adaptive.py), and the acceptance rule (verify.py)."""
