"""Engine settings the tests share, by what they are for. An engine's compiled executables are
keyed by its shapes (batch and token buckets, KV pool, dtype), so tests of one model that use one
preset load each other's executables from the session's compilation cache instead of compiling.

Bucket counts drive start-up time: `max_running_requests` gives the decode batch sizes (2, 4, 8,
16, ...) and `max_prefill_tokens` the prefill token sizes (32, 48, 64, 96, ...), each with request
counts 2, 8, ... up to the running requests (jaxrunner/batch/buckets.py)."""

# What every engine of the suite starts from (the `engine_kwargs` fixture adds the session's
# compilation cache and the compile-after-warm-up guard): float32 for HF parity, 16 running
# requests and 512-token prefills (4 decode and 27 prefill buckets).
SUITE_ENGINE = dict(dtype="float32", page_size=16, max_total_tokens=32768,
                    max_running_requests=16, max_prefill_tokens=512, show_progress=False)

# Speculative decoding: batches of 2 requests (one real row padded, or two) and prefill steps of
# 32 tokens, so every engine compiles a handful of programs (a target's verify program is the
# costliest to compile, ~4 s here; one bucket of 2 requests started an engine in 0.58x the time
# of two buckets, 2 and 4); a 16-request workload then runs in waves, chunked and sharing
# prefixes.
SPECULATIVE_ENGINE = dict(max_running_requests=2, max_prefill_tokens=32, max_total_tokens=8192)

# Two requests of up to 128 prompt tokens in one prefill (the quantization tests' two ragged
# prompts): a fraction of the suite engine's buckets.
TWO_PROMPT_ENGINE = dict(max_running_requests=2, max_prefill_tokens=128)

# Multi-LoRA: 16 ragged prompts (some past a page) in EXTEND steps mixing every adapter, then
# DECODE steps of all 16; a prefill budget of 32 tokens, so prompts are chunked too.
LORA_ENGINE = dict(max_running_requests=16, max_prefill_tokens=32, max_loras_per_batch=2,
                   max_lora_rank=16)

# Engines in subprocesses over simulated devices (tests/parallel/driver.py): few buckets and
# short sequences (decode batches of 2 and 4, prefills of 32 tokens: the 40-token prompts are
# chunked), so every engine compiles 4 step executables in seconds.
PARALLEL_ENGINE = dict(dtype="float32", page_size=16, max_total_tokens=1024,
                       max_running_requests=4, max_prefill_tokens=32, context_length=256,
                       show_progress=False, skip_tokenizer_init=True,
                       disallow_compile_after_warmup=True)

# EngineArgs for steps lowered for a TPU or a GPU from this CPU (`lower_only`): bfloat16, the
# Pallas kernel, batches of 8 and 64-token prefills; nothing is compiled or cached.
LOWERING_ENGINE = dict(model_path="unused", dtype="bfloat16", attention_backend="pallas",
                       max_total_tokens=4096, max_running_requests=8, max_prefill_tokens=64,
                       compilation_cache_dir=None, show_progress=False)
