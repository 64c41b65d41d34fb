"""Inter-process communication: message types, their codec, and the spawn trampoline."""
