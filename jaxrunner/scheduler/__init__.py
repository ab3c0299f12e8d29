"""Continuous batching on the host (no jax): admission, chunked prefill, MIXED batches, retraction, overlap."""
