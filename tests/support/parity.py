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
    scheduler.kv.allocate(batch)  # as the scheduler does: evicting (reclaiming) cached KV first
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


def hf_float32(path):
    """transformers' model of a checkpoint in float32, on one torch thread: on a busy 2-core
    machine torch's thread pool spins against the other processes and HF's generate runs 20x
    slower than single-threaded."""
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_greedy_matches_hf_generate(engine, hf, prompts, max_new_tokens: int):
    """Our greedy tokens for `prompts` (one generate call) are HF `generate`'s; returns ours."""
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0.0})
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                               do_sample=False)
        assert out["output_ids"] == want[0, len(prompt):].tolist(), f"{len(prompt)} tokens"
    return outs


def hf_router_counts(hf, routers, sequences, num_experts: int) -> np.ndarray:
    """[len(routers), num_experts]: how often each of HF's router modules (whose outputs hold
    the chosen experts third: (logits, weights, indices)) picks each expert over the tokens of
    `sequences`."""
    picked = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda m, i, out, k=k: picked[k].append(out[2]))
             for k, router in enumerate(routers)]
    try:
        with torch.no_grad():
            for seq in sequences:
                hf(torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    return np.stack([np.bincount(torch.cat(p).numpy().ravel(), minlength=num_experts)
                     for p in picked])


# A serving workload for parity tests: 16 ragged requests, several past a 64-token prefill chunk,
# three sharing their first 48 tokens with another (request i with request j), served with the
# radix cache and chunked prefill on.
RAGGED_REQUEST_LENS = [3, 150, 17, 90, 1, 65, 40, 120, 8, 33, 100, 5, 70, 12, 128, 48]
SHARED_PREFIXES = {4: 1, 9: 7, 13: 10}
RAGGED_ENGINE = dict(max_running_requests=8, max_prefill_tokens=128, chunked_prefill_size=64)


def ragged_requests(vocab_size: int, seed: int = 1) -> list[list[int]]:
    """The workload's prompts."""
    prompts = prompts_of_lengths(vocab_size, RAGGED_REQUEST_LENS, seed=seed)
    for i, j in SHARED_PREFIXES.items():
        prompts[i] = prompts[j][:48] + prompts[i]
    return prompts


def assert_ragged_requests_match_hf_generate(engine, hf, prompts, max_new_tokens: int = 32):
    """`ragged_requests` served (an engine of RAGGED_ENGINE) give HF generate's greedy tokens
    with no compile after warm-up, the radix cache serving the shared prefixes, and every page
    free once the cache is flushed; returns the outputs."""
    compiles = engine.compile_monitor.count
    outs = assert_greedy_matches_hf_generate(engine, hf, prompts, max_new_tokens)
    assert engine.compile_monitor.count == compiles
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 48  # the radix cache served
    assert engine.flush_cache()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity
    return outs
