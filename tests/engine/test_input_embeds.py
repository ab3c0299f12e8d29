"""Prompts given as embeddings (`input_embeds`) and embeddings spliced into prompt positions
(`replace_embeds`): inside the compiled prefill steps with no compile, mixed with token prompts
in one batch, checked against Hugging Face run on the same spliced embeddings, and kept out of
the prefix cache from the first given embedding on."""

import numpy as np
import pytest
import torch

from jaxrunner.batch.input_embeds import make_override
from tests.support.engine import CompileCounter
from tests.support.parity import prefill_logits

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def embedding(engine):
    """The model's embedding table [V, D], read back from the engine."""
    return engine.get_weights_by_name("model.embed_tokens.weight", 10**6)


def _prompts(engine, lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, engine.model_config.vocab_size, size=n).tolist() for n in lens]


def _ids(outs):
    return [o["output_ids"] for o in outs]


def test_input_embeds_of_the_prompts_own_embeddings_give_identical_outputs(engine, embedding):
    # 600 tokens: prefilled in two chunks (max_prefill_tokens 512), the rows split between them.
    prompts = _prompts(engine, [7, 600, 33])
    want = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    with CompileCounter() as compiles:
        got = engine.generate(input_embeds=[embedding[p] for p in prompts],
                              sampling_params=GREEDY)
        # Mixed with token prompts in one batch: one entry per request in each list.
        mixed = engine.generate(input_ids=[prompts[0], None, prompts[2]],
                                input_embeds=[None, embedding[prompts[1]], None],
                                sampling_params=GREEDY)
        one = engine.generate(input_embeds=embedding[prompts[0]], sampling_params=GREEDY)
    assert compiles.count == 0
    assert _ids(got) == want and _ids(mixed) == want and one["output_ids"] == want[0]
    assert [o["meta_info"]["prompt_tokens"] for o in got] == [7, 600, 33]


def _spliced_reference(hf_llama, ids, positions, rows):
    """HF logits [n, V] of the prompt with the embeddings at `positions` replaced."""
    with torch.no_grad():
        embeds = hf_llama.model.embed_tokens(torch.tensor([ids]))
        embeds[0, positions] = torch.from_numpy(rows)
        return hf_llama(inputs_embeds=embeds).logits[0].numpy()


def test_replace_embeds_changes_the_logits_from_the_replaced_positions_on(engine, hf_llama):
    rng = np.random.default_rng(1)
    prompts = _prompts(engine, [40, 21], seed=1)
    hidden = engine.model_config.hidden_size
    positions = [17, 18, 30]
    rows = (rng.standard_normal((3, hidden)) * 0.5).astype(np.float32)
    override = make_override(rows, positions, len(prompts[0]), hidden)
    replaced, plain = prefill_logits(engine, prompts, [override, None])[0]
    original, _ = prefill_logits(engine, prompts, [None, None])[0]
    want = _spliced_reference(hf_llama, prompts[0], positions, rows)
    rel = np.abs(replaced - want).max() / np.abs(want).max()
    assert rel < 1e-4, f"relative error {rel:.2e} against HF on the spliced embeddings"
    np.testing.assert_allclose(replaced[:17], original[:17], rtol=1e-5, atol=1e-5)
    assert (np.abs(replaced[17:] - original[17:]).max(axis=-1) > 1e-3).all()
    # The token prompt beside it in the batch is untouched.
    untouched = _spliced_reference(hf_llama, prompts[1], [], np.zeros((0, hidden), np.float32))
    np.testing.assert_allclose(plain, untouched, rtol=1e-4, atol=1e-4 * np.abs(plain).max())


def test_generation_continues_from_the_spliced_prompt_as_hf_does(engine, hf_llama):
    rng = np.random.default_rng(2)
    (prompt,) = _prompts(engine, [25], seed=2)
    positions = [3, 4, 5, 6]
    rows = (rng.standard_normal((4, engine.model_config.hidden_size)) * 0.5).astype(np.float32)
    with CompileCounter() as compiles:
        out = engine.generate(input_ids=prompt, replace_embeds=rows, replace_positions=positions,
                              sampling_params=GREEDY)
    assert compiles.count == 0
    ids = list(prompt)
    with torch.no_grad():
        embeds = hf_llama.model.embed_tokens(torch.tensor([ids]))
        embeds[0, positions] = torch.from_numpy(rows)
        for _ in range(GREEDY["max_new_tokens"]):
            token = int(hf_llama(inputs_embeds=embeds).logits[0, -1].argmax())
            ids.append(token)
            new = hf_llama.model.embed_tokens(torch.tensor([[token]]))
            embeds = torch.cat([embeds, new], dim=1)
    assert out["output_ids"] == ids[len(prompt):]


def test_the_prefix_cache_shares_only_the_tokens_before_the_first_given_embedding(
        engine, embedding):
    assert engine.flush_cache()
    (prompt,) = _prompts(engine, [60], seed=3)
    plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.flush_cache()
    rows = embedding[[7, 8]] * 3.0
    spliced = engine.generate(input_ids=prompt, replace_embeds=rows, replace_positions=[40, 41],
                              sampling_params=GREEDY)
    assert spliced["output_ids"] != plain["output_ids"]
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    # Pages of 16: the two whole pages before position 40 are shared, nothing from 40 on.
    assert again["meta_info"]["cached_tokens"] == 32
    assert again["output_ids"] == plain["output_ids"]
    # A prompt given wholly as embeddings caches nothing; its placeholder ids match nothing.
    emb_prompt = embedding[prompt]
    first = engine.generate(input_embeds=emb_prompt, sampling_params=GREEDY)
    second = engine.generate(input_embeds=emb_prompt, sampling_params=GREEDY)
    zeros = engine.generate(input_ids=[0] * 60, sampling_params=GREEDY)
    assert [first["meta_info"]["cached_tokens"], second["meta_info"]["cached_tokens"],
            zeros["meta_info"]["cached_tokens"]] == [0, 0, 0]
    assert first["output_ids"] == second["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(input_embeds=np.zeros((3, 7))), r"shape \[tokens, hidden_size=256\], got \[3, 7\]"),
    (dict(input_embeds=np.full((3, 256), np.nan)), "NaN"),
    (dict(input_embeds=[]), "input_embeds is empty"),
    (dict(input_ids=[1, 2, 3], replace_embeds=np.zeros((1, 256)), replace_positions=[3]),
     r"prompt positions in \[0, 3\)"),
    (dict(input_ids=[1, 2, 3], replace_embeds=np.zeros((2, 256)), replace_positions=[1, 1]),
     "repeats position 1"),
    (dict(input_ids=[1, 2, 3], replace_embeds=np.zeros((2, 256)), replace_positions=[1]),
     "2 embeddings for 1 replace_positions"),
    (dict(input_ids=[1, 2, 3], replace_embeds=np.zeros((1, 256))), "together"),
    (dict(input_ids=[[1, 2], None], input_embeds=[np.zeros((2, 256)), None]),
     "request 0: give exactly one"),
    (dict(prompt="text", input_embeds=np.zeros((2, 256))), "not both"),
])
def test_bad_embeddings_raise_a_clear_error_and_nothing_is_queued(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(sampling_params=GREEDY, **kwargs)
    assert not engine.has_unfinished_requests
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"][
        "completion_tokens"] == GREEDY["max_new_tokens"]
