"""The engine: the pure step (core), its process shell, clients, and the public APIs."""
