"""Sampling: per-request parameters, the padded batch of them, the compiled sampler and penalties, and grammar masks."""
