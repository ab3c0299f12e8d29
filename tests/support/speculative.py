"""Speculative decoding tests' workload, serving check and references: the chi-square test of a
sampled distribution, and an independent PyTorch EAGLE / EAGLE-3 head."""

import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy import stats
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from jaxrunner import Engine
from tests.support.engine import CompileCounter
from tests.support.presets import SPECULATIVE_ENGINE


def speculative_workload(vocab: int, n: int = 16, seed: int = 0):
    """(prompts, greedy params): ragged prompts in families sharing a prefix, some of them
    repeating themselves (so n-gram lookup has something to find)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(8, vocab, size=int(rng.integers(20, 70))).tolist() for _ in range(3)]
    prompts = []
    for i in range(n):
        suffix = rng.integers(8, vocab, size=int(rng.integers(1, 30))).tolist()
        prompts.append(prefixes[i % 3] + suffix + (suffix[:8] * 2 if i % 2 else []))
    params = [{"max_new_tokens": int(rng.integers(4, 24)), "temperature": 0.0,
               "ignore_eos": True} for _ in range(n)]
    return prompts, params


def serve_checked(model_path, engine_kwargs, prompts, params, check=None, **spec):
    """The outputs of `prompts` (in two waves) on a SPECULATIVE_ENGINE with `spec`, checked for
    compiles after warm-up, the refusal of given embeddings, and leaked pages or slots;
    `check(engine)` checks more before it shuts down."""
    engine = Engine(model_path=str(model_path),
                    **dict(engine_kwargs, **SPECULATIVE_ENGINE, **spec))
    try:
        half = len(prompts) // 2
        with CompileCounter() as counter:
            outs = (engine.generate(input_ids=prompts[:half], sampling_params=params[:half])
                    + engine.generate(input_ids=prompts[half:], sampling_params=params[half:]))
        assert counter.count == 0, f"{counter.count} compiles after warm-up"
        if spec:  # the draft would not see given embeddings: refused, and serving goes on
            hidden = engine.model_config.hidden_size
            with pytest.raises(ValueError, match="speculative decoding"):
                engine.generate(input_embeds=np.zeros((3, hidden), np.float32),
                                sampling_params=params[0])
        assert engine.flush_cache()
        scheduler = engine.scheduler
        assert scheduler.allocator.num_free == scheduler.allocator.capacity, "pages leaked"
        assert scheduler.req_to_token_pool.num_free_slots == scheduler.req_to_token_pool.num_slots
        if check is not None:
            check(engine)
        return outs
    finally:
        engine.shutdown()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square goodness-of-fit p-value of observed `counts` against `probs`, the rare
    outcomes (expected count under 5) merged into one cell."""
    keep = probs * counts.sum() >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed, expected).pvalue


def target_first_token_probs(logits) -> np.ndarray:
    """p_0 after temperature 1, top-k 6 and top-p 0.9, in numpy."""
    z = np.asarray(logits[0], np.float64)
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    keep[order[:6]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    sorted_p = p[order]
    cum = np.cumsum(sorted_p) - sorted_p
    kept = order[(cum < 0.9) & (sorted_p > 0)]
    q = np.zeros_like(p)
    q[kept] = p[kept]
    return q / q.sum()


def _rms(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def torch_head(head_dir, algorithm, target, tokens_next, hidden, own=None):
    """An independent EAGLE / EAGLE-3 head: tokens_next [P] (the token after each position),
    hidden [P, Hc] (the target's; or its first P - Q rows, then `own` [Q, D]: the head's own
    outputs, as its draft steps read them) -> (output [P, D], logits [P, V_draft])."""
    w = {k: torch.from_numpy(np.asarray(v))
         for k, v in load_file(head_dir / "model.safetensors").items()}
    cfg = LlamaConfig.from_pretrained(head_dir)
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.head_dim
    embeds = target.model.embed_tokens(torch.tensor(tokens_next))
    eagle3 = algorithm == "EAGLE3"
    p = "midlayer." if eagle3 else "layers.0."
    if own is not None and not eagle3:
        hidden = torch.cat([hidden, own], 0)
    if eagle3:
        h = hidden @ w["fc.weight"].T
        if own is not None:  # the head's own outputs skip fc
            h = torch.cat([h, own], 0)
        x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], eps),
                       _rms(h, w[p + "hidden_norm.weight"], eps)], -1)
        residual = h
    else:
        x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        residual = x
    P = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(1, P, nh, hd).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(1, P, nkv, hd).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(1, P, nkv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.arange(P)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(P, P, dtype=torch.bool), 1), -torch.inf)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(P, nh * hd)
    residual = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    hn = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(hn @ w[p + "mlp.gate_proj.weight"].T)
           * (hn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    out = residual + mlp
    if eagle3:
        logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
    else:
        logits = target.lm_head(out)
    return out, logits


