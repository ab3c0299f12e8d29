"""Speculative decoding: EAGLE and EAGLE-3 heads, a standalone draft model and n-gram lookup,
through TARGET_VERIFY and DRAFT_EXTEND steps (jaxrunner/speculative/spec_worker.py)."""
