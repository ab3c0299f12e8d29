"""Load formats: an orbax checkpoint converted from a Hugging Face one loads (and updates) to the
same weights and logits as the safetensors; dummy weights come from config.json alone, made on
the device, with the scales they are meant to have."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrunner import Engine
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.sampling.params import SamplingParams
from models.loading.load_format import hashed_uniform, resolve_load_format
from tests.support.engine import CompileCounter

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 160)), [42] * 17]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _logits(engine):
    """Next-token logits of PROMPTS from one EXTEND batch (plus the greedy tokens)."""
    worker, scheduler = engine.worker, engine.scheduler
    reqs = [Req(rid=20_000 + i, origin_input_ids=p, max_new_tokens=1, seed=0,
                sampling_params=SamplingParams(temperature=0.0).normalized(),
                eos_token_ids=frozenset()) for i, p in enumerate(PROMPTS)]
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND, [len(p) for p in PROMPTS],
                          scheduler.req_to_token_pool, scheduler.allocator, engine.args.page_size)
    assert batch.alloc_kv()
    wb = batch.get_model_worker_batch(worker.pick_bucket(ForwardMode.EXTEND, batch.num_tokens, 3))
    try:
        out = worker.forward_batch_generation(wb).logits_output
        return np.asarray(out.next_token_logits)[:3]
    finally:
        for req in reqs:
            scheduler.allocator.free(scheduler.req_to_token_pool.free_slot(req.req_pool_idx))


def test_orbax_loads_the_same_weights_and_logits_as_safetensors(orbax_llama, checkpoint,
                                                               engine_kwargs):
    hf_dir = checkpoint("tiny-llama")
    assert resolve_load_format("auto", orbax_llama) == "orbax"
    assert resolve_load_format("auto", hf_dir) == "safetensors"
    assert (orbax_llama / "tokenizer.json").is_file()
    engine = Engine(model_path=str(orbax_llama), **engine_kwargs)
    try:
        assert engine.runner.load_format == "orbax"
        hf = load_file(str(hf_dir / "model.safetensors"))
        for name in ("model.layers.1.self_attn.v_proj.weight", "model.norm.weight",
                     "lm_head.weight", "model.embed_tokens.weight"):
            np.testing.assert_array_equal(engine.get_weights_by_name(name, 10**6), hf[name])
        from_orbax = _logits(engine)
        tokens = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                           sampling_params=GREEDY)]
        with CompileCounter() as compiles:
            assert engine.update_weights_from_disk(str(hf_dir), "safetensors")[0]
            from_safetensors = _logits(engine)
            assert engine.update_weights_from_disk(str(orbax_llama))[0]  # auto: orbax
            again = _logits(engine)
        assert compiles.count == 0
        np.testing.assert_allclose(from_orbax, from_safetensors, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(again, from_orbax)
        assert tokens == [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                                   sampling_params=GREEDY)]
    finally:
        engine.shutdown()


def test_dummy_weights_from_a_config_alone(checkpoint, engine_kwargs, tmp_path):
    config = json.loads((checkpoint("tiny-qwen2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights, no tokenizer
    with pytest.raises(FileNotFoundError, match="no weights in .*load_format='dummy'"):
        resolve_load_format("auto", tmp_path)
    # Three prompts need no more than 4 decode rows and 32-token prefill steps: few buckets.
    engine = Engine(model_path=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                    **dict(engine_kwargs, max_running_requests=4, max_prefill_tokens=32))
    try:
        with CompileCounter() as compiles:
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert compiles.count == 0
        ids = [o["output_ids"] for o in outs]
        assert len({tuple(i) for i in ids}) == 3  # the outputs follow the prompts
        get = engine.get_weights_by_name
        q = get("model.layers.1.self_attn.q_proj.weight", 10**6)  # [out, in] = [256, 256]
        assert q.std() == pytest.approx(256 ** -0.5, rel=0.05)
        assert abs(q.mean()) < 0.01 * q.std()
        down = get("model.layers.0.mlp.down_proj.weight", 10**6)  # fan-in 512
        assert down.std() == pytest.approx(512 ** -0.5, rel=0.05)
        assert get("model.embed_tokens.weight", 10**6).std() == pytest.approx(1.0, rel=0.05)
        np.testing.assert_array_equal(get("model.norm.weight", 256), np.ones(256, np.float32))
        np.testing.assert_array_equal(get("model.layers.0.self_attn.q_proj.bias", 256), np.zeros(256))
        # Layers of one stacked parameter differ; a second engine makes the same weights.
        assert not np.array_equal(q, get("model.layers.0.self_attn.q_proj.weight", 10**6))
        ok, message = engine.update_weights_from_disk(str(tmp_path), "dummy")
        assert not ok and "'dummy' has no weights" in message
    finally:
        engine.shutdown()


def test_hashed_uniform_is_uniform_deterministic_and_salted():
    a = np.asarray(hashed_uniform((3, 64, 128), salt=5))
    assert a.min() >= -1.0 and a.max() < 1.0
    assert abs(a.mean()) < 0.01 and a.std() == pytest.approx(3 ** -0.5, rel=0.01)
    np.testing.assert_array_equal(a, np.asarray(hashed_uniform((3, 64, 128), salt=5)))
    assert np.abs(np.corrcoef(a[0].ravel(), a[1].ravel())[0, 1]) < 0.02  # layers independent
    assert not np.array_equal(a, np.asarray(hashed_uniform((3, 64, 128), salt=6)))
    # Neighbouring elements are not correlated either (a hash, not a sequence).
    assert np.abs(np.corrcoef(a[0, :, :-1].ravel(), a[0, :, 1:].ravel())[0, 1]) < 0.02
