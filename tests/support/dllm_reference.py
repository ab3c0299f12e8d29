"""An independent reference for block-diffusion decoding (SDAR, LowConfidence), in numpy float32.

No KV cache, no paging, no engine code: every step recomputes the whole sequence (prompt,
decided blocks and the current block) with a dense block-causal mask from the checkpoint's
safetensors, and applies the low-confidence rule as its docstring in jaxrunner/dllm/algorithm.py
states it. Greedy only (sampling would need the engine's random stream).
"""

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class Qwen3Reference:
    """Qwen3's network (SDAR's) in float32 numpy, over a whole sequence with a given mask."""

    def __init__(self, model_dir):
        model_dir = Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            self.w.update({k: v.astype(np.float32) for k, v in load_file(f).items()})

    def _norm(self, x, weight):
        eps = self.cfg["rms_norm_eps"]
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def _rope(self, x, positions):  # x [T, H, D]; HF's rotate_half layout, default rope
        d = x.shape[-1]
        inv_freq = 1.0 / (self.cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
        freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb).astype(np.float32)[:, None], np.sin(emb).astype(np.float32)[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

    def logits(self, ids, visible):
        """ids [T], visible bool[T, T] (query, key) -> f32[T, V]."""
        c, w = self.cfg, self.w
        T, H, K, D = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = w["model.embed_tokens.weight"][np.asarray(ids)]
        pos = np.arange(T)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = self._norm(x, w[f"{p}.input_layernorm.weight"])
            q = (h @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, H, D)
            k = (h @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, K, D)
            v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, K, D)
            q = self._rope(self._norm(q, w[f"{p}.self_attn.q_norm.weight"]), pos)
            k = self._rope(self._norm(k, w[f"{p}.self_attn.k_norm.weight"]), pos)
            k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
            s = np.where(visible[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(T, H * D)
            x = x + a @ w[f"{p}.self_attn.o_proj.weight"].T
            h = self._norm(x, w[f"{p}.post_attention_layernorm.weight"])
            gate = h @ w[f"{p}.mlp.gate_proj.weight"].T
            up = h @ w[f"{p}.mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x @ head.T


def block_causal(T: int, block: int) -> np.ndarray:
    """bool[T, T]: position q sees k when k's block is not after q's."""
    b = np.arange(T) // block
    return b[None, :] <= b[:, None]


def generate(model: Qwen3Reference, prompt, *, block: int, steps_per_block: int,
             threshold: float, mask_id: int, max_new_tokens: int, stop_ids=()):
    """Greedy LowConfidence decoding of one prompt. Returns (output ids, the block states after
    every step of every decided block: a list per block of lists of B ids)."""
    seq = list(prompt)
    start = len(prompt) // block * block
    log, out = [], []
    while True:
        cur = seq[start:] + [mask_id] * (start + block - len(seq))
        history = []
        for step in range(steps_per_block):
            ids = seq[:start] + cur
            logits = model.logits(ids, block_causal(len(ids), block))[start:]
            logits[:, mask_id] = -np.inf
            x0 = logits.argmax(-1)
            e = np.exp(logits - logits.max(-1, keepdims=True))
            p = (e / e.sum(-1, keepdims=True))[np.arange(block), x0]
            undecided = [i for i in range(block) if cur[i] == mask_id]
            k = -(-len(undecided) // (steps_per_block - step))
            by_conf = sorted(undecided, key=lambda i: (-p[i], i))
            commit = set(by_conf[:k]) | {i for i in undecided if p[i] > threshold}
            cur = [int(x0[i]) if i in commit else t for i, t in enumerate(cur)]
            history.append(cur)
            if mask_id not in cur:
                break
        log.append(history)
        new = cur[max(0, len(prompt) - start):]
        for t in new:
            out.append(t)
            if t in stop_ids or len(out) >= max_new_tokens:
                return out, log
        seq = seq[:start] + cur
        start += block
