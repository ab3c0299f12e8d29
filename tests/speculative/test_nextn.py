"""NEXTN: DeepSeek-V3's multi-token-prediction layer as the draft (models/deepseek_mtp.py) on
tiny-deepseek-v3 (MLA with a latent cache for the target and the draft, DeepSeekMoE). Greedy
tokens are the target's own with no compile after warm-up and every page back, rounds are
reported, sampled tokens keep the engine's distribution, the head's output and its first draft
are transformers' MtpLayer's on the same tensors, and a checkpoint without MTP layers is
refused by name."""

import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy import stats
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                  DeepseekV3RMSNorm)

from jaxrunner import Engine
from tests.support.engine import CompileCounter
from tests.support.presets import SPECULATIVE_ENGINE
from tests.support.speculative import speculative_workload

PRESET = "tiny-deepseek-v3"
STEPS = 3
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=STEPS)
SEEDS = 200  # sampled requests per engine for the distribution test


@pytest.fixture(scope="module")
def engines(checkpoint, engine_kwargs):
    """(plain engine, NEXTN engine) of tiny-deepseek-v3."""
    path = str(checkpoint(PRESET))
    plain = Engine(model_path=path, **dict(engine_kwargs, **SPECULATIVE_ENGINE))
    nextn = Engine(model_path=path, **dict(engine_kwargs, **SPECULATIVE_ENGINE, **NEXTN))
    yield plain, nextn
    plain.shutdown()
    nextn.shutdown()


def _generate(engine, prompts, params):
    with CompileCounter() as counter:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert counter.count == 0, f"{counter.count} compiles after warm-up"
    assert engine.flush_cache()
    scheduler = engine.scheduler
    assert scheduler.allocator.num_free == scheduler.allocator.capacity, "pages leaked"
    return outs


def test_nextn_keeps_the_targets_greedy_tokens_and_reports_rounds(engines):
    plain, nextn = engines
    prompts, params = speculative_workload(plain.model_config.vocab_size)
    want = [o["output_ids"] for o in _generate(plain, prompts, params)]
    outs = _generate(nextn, prompts, params)
    assert [o["output_ids"] for o in outs] == want
    for out, p in zip(outs, params):
        meta = out["meta_info"]
        assert meta["completion_tokens"] == p["max_new_tokens"]
        # The prefill gives the first token; every verify round one more at least.
        assert 1 <= meta["spec_verify_ct"] <= p["max_new_tokens"] - 1
    # The draft's KV is the MTP layer's latent rows, on the target's pages.
    draft, target = nextn.worker.draft, nextn.runner.token_to_kv_pool
    assert draft.token_to_kv_pool.shape == (1, *target.shape[1:])


def test_sampling_keeps_the_engines_distribution(engines):
    """The first two sampled tokens of a prompt over many seeds, with and without NEXTN: a
    two-sample chi-square test cannot tell them apart."""
    prompt = list(range(40, 60)) * 2
    params = [{"max_new_tokens": 3, "temperature": 1.0, "seed": s, "ignore_eos": True}
              for s in range(SEEDS)]
    samples = [[tuple(o["output_ids"][:2]) for o in _generate(e, [prompt] * SEEDS, params)]
               for e in engines]
    for position in (0, 1):
        a, b = ([s[position] for s in side] for side in samples)
        values = sorted(set(a) | set(b))
        table = np.array([[a.count(v) for v in values], [b.count(v) for v in values]])
        table = table[:, table.sum(0) >= 10]
        if table.shape[1] > 1:
            assert stats.chi2_contingency(table).pvalue > 1e-3, position


def _hf_mtp_layer(path, target):
    """transformers' own MtpLayer with the checkpoint's MTP layer loaded (its experts fused as
    transformers holds them)."""
    cfg = target.config.get_mtp_config()
    layer = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).eval()
    prefix = f"model.layers.{target.config.num_hidden_layers}."
    tensors = {}
    for name, value in load_file(f"{path}/model.safetensors").items():
        rest = name.removeprefix(prefix)
        if rest == name or rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        if rest.startswith("shared_head.norm."):
            rest = "post_norm." + rest.removeprefix("shared_head.norm.")
        elif not rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            rest = "mtp_block." + rest
        tensors[rest] = value
    experts = "mtp_block.mlp.experts"

    def stack(leaf):
        return np.stack([tensors.pop(f"{experts}.{e}.{leaf}.weight")
                         for e in range(cfg.n_routed_experts)])
    tensors[f"{experts}.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], 1)
    tensors[f"{experts}.down_proj"] = stack("down_proj")
    missing, unexpected = layer.load_state_dict(
        {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return layer


def test_the_mtp_head_matches_transformers_mtp_layer(engines, checkpoint):
    _, engine = engines
    path = checkpoint(PRESET)
    prompt = np.random.default_rng(3).integers(8, 1024, size=37).tolist()
    req = engine.add_request(prompt, {"max_new_tokens": 4, "temperature": 0.0,
                                      "ignore_eos": True})
    while len(req.output_ids) < 1:  # the prefill: the target, then the head over the prompt
        engine.step()
    draft = engine.worker.draft
    ours = np.asarray(draft.draft_state.hidden)[req.req_pool_idx]
    first_draft = int(np.asarray(draft.draft_state.tokens)[req.req_pool_idx, 0])
    sampled = req.output_ids[0]
    while engine.has_unfinished_requests:
        engine.step()
    engine.flush_cache()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layer = _hf_mtp_layer(path, target)
    with torch.no_grad():
        hidden = target.model(torch.tensor([prompt])).last_hidden_state  # after the norm
        embeds = target.model.embed_tokens(torch.tensor([prompt[1:] + [sampled]]))
        positions = torch.arange(len(prompt))[None]
        out = layer(embeds, hidden, target.model.rotary_emb(hidden, positions), None,
                    positions, None)[0]
        logits = target.lm_head(out)
    want = out[-1].numpy()
    assert np.abs(ours - want).max() / np.abs(want).max() < 1e-4
    assert first_draft == int(torch.argmax(logits[-1]))


@pytest.mark.parametrize("preset,message", [
    ("tiny-deepseek-v2", "num_nextn_predict_layers=0"),
    ("tiny-llama", "num_nextn_predict_layers=0"),
])
def test_nextn_without_mtp_layers_is_refused(preset, message, checkpoint):
    with pytest.raises(ValueError, match=message):
        Engine(model_path=str(checkpoint(preset)), **NEXTN)
