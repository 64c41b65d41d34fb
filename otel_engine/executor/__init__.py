"""Executors run the model for the engine core: in-process (TP=1) or on worker processes."""
