"""Mixture-of-experts serving tools: where experts live and moving them, the expert distribution recorder, and EPLB."""
