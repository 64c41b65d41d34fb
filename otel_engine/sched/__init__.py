"""Scheduling: requests, the KV block allocator and the continuous-batching scheduler."""
