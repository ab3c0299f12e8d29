"""Embedding and classification (reward) models: SGLang's `is_generation=False`.

A pooling model's requests run through the same scheduler, buckets and executables as a causal
LM's prefill and never decode. The runner's EXTEND program is the pooling step (plan.py,
step.py): the decoder over a prefill chunk, then each request's pooled state (its last token's
hidden state, or the sum of its tokens' for mean pooling) through the model's head. The
scheduler keeps each chunk's result on the request (output.py), which ends after its prompt;
the embedding (mean, Matryoshka truncation, normalisation) or the scores are made from it on the
host. The engine's API is `Engine.encode`; the server's `/v1/embeddings`, `/encode`, `/classify`
and `/v1/classify` (jaxrunner/server/pooling_api.py).
"""
