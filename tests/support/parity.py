"""Our logits and tokens against Hugging Face transformers (PyTorch) on the same checkpoint."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.sampling.params import SamplingParams


def prompts_of_lengths(vocab_size: int, lens, seed: int = 0) -> list[list[int]]:
    """One random prompt per length in `lens` (token ids 3 and up)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in lens]


def prefill_logits(engine, prompts, overrides=None):
    """Logits at every prompt position from one ragged EXTEND batch through the model worker
    (each prompt with its `EmbedOverride` or None), and the serving path's last-token logits:
    ([T_i, V] per prompt, [R, V])."""
    worker, scheduler = engine.worker, engine.scheduler
    overrides = overrides or [None] * len(prompts)
    reqs = [Req(rid=10_000 + i, origin_input_ids=p,
                sampling_params=SamplingParams(temperature=0.0).normalized(), seed=0,
                max_new_tokens=1, eos_token_ids=frozenset(), embed_override=o)
            for i, (p, o) in enumerate(zip(prompts, overrides))]
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND, [len(p) for p in prompts],
                          scheduler.req_to_token_pool, scheduler.allocator, engine.args.page_size)
    assert batch.alloc_kv()
    worker_batch = batch.get_model_worker_batch(
        worker.pick_bucket(ForwardMode.EXTEND, batch.num_tokens, len(reqs)))
    worker_batch.capture_hidden_mode = CaptureHiddenMode.FULL
    # Hidden-state capture compiles on first use: this engine's own compile, which another warm
    # engine of the process must not refuse either.
    try:
        with engine.compile_monitor.allowed():
            out = worker.forward_batch_generation(worker_batch).logits_output
            logits = np.asarray(engine.runner.compute_logits(out.hidden_states))
    finally:
        for req in reqs:
            scheduler.allocator.free(scheduler.req_to_token_pool.free_slot(req.req_pool_idx))
    last = np.asarray(out.next_token_logits)
    starts = np.cumsum([0] + [len(p) for p in prompts])
    assert logits.shape[0] >= starts[-1], f"captured {logits.shape[0]} of {starts[-1]} tokens"
    return [logits[s:s + len(p)] for s, p in zip(starts, prompts)], last


def hf_logits(hf, prompt) -> np.ndarray:
    """An HF model's float logits [T, V] over one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest absolute difference relative to the largest magnitude of `want`."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_prefill_logits_match(engine, hf, prompts) -> None:
    """The prompts' logits at every position from one ragged EXTEND batch are HF's within
    1e-4 relative, the serving path's last-token logits the same numbers, and every page is
    back afterwards."""
    ours, last = prefill_logits(engine, prompts)
    for i, (prompt, got) in enumerate(zip(prompts, ours)):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"prompt {i} ({len(prompt)} tokens): relative error {rel:.2e}"
        np.testing.assert_allclose(last[i], got[-1], rtol=1e-5, atol=1e-5)
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity


def hf_greedy_tokens(path, prompts, n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, `n` tokens, each step a whole-sequence
    pass in float32 (no KV cache)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs
