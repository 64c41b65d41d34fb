"""Model code: the Llama-family decoder, its layers, paged attention, sampling and loading."""
