"""The engine's lifecycle for RL rollouts: memory release and resume, weight updates from disk
and from tensors (checked against Hugging Face on the same weights), reading weights back, and
what happens to requests in flight. No serving executable compiles across any of it."""

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.engine.lifecycle import EngineNotReadyError
from models.testing.random_checkpoint import cached_checkpoint
from tests.support.engine import CompileCounter

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 33]


@pytest.fixture(scope="module")
def first(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def second(checkpoint_root):
    """The same architecture with other random weights."""
    return cached_checkpoint("tiny-llama", checkpoint_root / "seed-1", seed=1)


@pytest.fixture(scope="module")
def engine(first, engine_kwargs):
    engine = Engine(model_path=str(first), enable_weights_cpu_backup=True, **engine_kwargs)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def first_weights_after(engine, first):
    """Every test leaves the module's engine on the first checkpoint's weights."""
    yield
    if engine.runner.released_tags:
        engine.resume_memory_occupation()
    assert engine.update_weights_from_disk(str(first))[0]


def _hf(path, replaced: dict | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if replaced:
        state = model.state_dict()
        state.update({n: torch.from_numpy(np.asarray(t, np.float32)) for n, t in replaced.items()})
        model.load_state_dict(state)
    return model


def _hf_greedy(model, prompts, n=GREEDY["max_new_tokens"]):
    """HF's argmax continuation of each prompt, EOS ignored as the engine's `ignore_eos`."""
    outs = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(p):])
    return outs


def _ids(outs):
    return [o["output_ids"] for o in outs]


def _live_bytes():
    return sum(x.nbytes for x in jax.live_arrays())


def test_release_frees_the_device_memory_and_resume_gives_identical_outputs(engine):
    runner = engine.runner
    before = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    held = runner.weights_bytes + runner.token_to_kv_pool.bytes
    with CompileCounter() as compiles:
        live = _live_bytes()
        engine.release_memory_occupation()
        freed = live - _live_bytes()
        assert freed >= 0.95 * held, f"freed {freed} of {held} bytes"
        assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(runner.state))
        with pytest.raises(EngineNotReadyError, match="released; resume_memory_occupation"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert not engine.has_unfinished_requests
        engine.resume_memory_occupation()
        assert not np.asarray(runner.token_to_kv_pool.kv_cache).any()  # back empty
        after = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert compiles.count == 0
    assert _ids(after) == before
    # The prefix cache was flushed: nothing was served from it.
    assert [o["meta_info"]["cached_tokens"] for o in after] == [0, 0, 0]


def test_release_one_tag_at_a_time(engine):
    before = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    kv_bytes = engine.runner.token_to_kv_pool.bytes
    live = _live_bytes()
    engine.release_memory_occupation(["kv_cache"])
    assert live - _live_bytes() >= 0.95 * kv_bytes
    with pytest.raises(EngineNotReadyError, match="kv_cache memory is released"):
        engine.add_request(PROMPTS[0], GREEDY)
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])
    with pytest.raises(EngineNotReadyError, match="kv_cache"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    engine.resume_memory_occupation(["kv_cache"])
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == before
    with pytest.raises(ValueError, match="unknown memory tag.*'cuda_graph'"):
        engine.release_memory_occupation(["cuda_graph"])


def test_release_lets_requests_in_flight_finish_first(engine):
    want = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    engine.release_memory_occupation()
    assert [r.output_ids for r in reqs] == want
    assert all(r.finished_reason["type"] == "length" for r in reqs)
    engine.resume_memory_occupation()


def test_without_cpu_backup_resume_then_update_from_disk_gives_the_weights_back(
        engine, first, engine_kwargs):
    engine = Engine(model_path=str(first), **engine_kwargs)  # beside the module's warm one
    try:
        before = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
        with CompileCounter() as compiles:
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
            with pytest.raises(EngineNotReadyError, match="update_weights_from_disk"):
                engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert engine.update_weights_from_disk(str(first)) == (
                True, f"updated the weights from {first} (safetensors)")
            after = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
        assert compiles.count == 0
        assert after == before
    finally:
        engine.shutdown()


def test_update_from_disk_serves_the_new_checkpoint_with_no_stale_prefix(engine, first, second):
    first_hf, second_hf = _hf_greedy(_hf(first), PROMPTS), _hf_greedy(_hf(second), PROMPTS)
    assert first_hf != second_hf
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == first_hf
    with CompileCounter() as compiles:
        ok, message = engine.update_weights_from_disk(str(second), weight_version="v2")
        assert ok, message
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert compiles.count == 0
    assert _ids(outs) == second_hf
    # The prompts' prefixes were cached on the old weights: none of it may be reused.
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 0]
    assert {o["meta_info"]["weight_version"] for o in outs} == {"v2"}
    assert engine.update_weights_from_disk(str(first))[0]
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == first_hf


def test_update_from_disk_lets_requests_in_flight_finish_on_the_old_weights(engine, second):
    old = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert any(r.output_ids for r in reqs) and not any(r.finished for r in reqs)
    assert engine.update_weights_from_disk(str(second))[0]
    assert [r.output_ids for r in reqs] == old


def test_update_from_disk_can_abort_requests_in_flight(engine, second):
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.update_weights_from_disk(str(second), abort_all_requests=True)[0]
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    assert all(len(r.output_ids) < GREEDY["max_new_tokens"] for r in reqs)
    scheduler = engine.scheduler
    assert scheduler.allocator.num_free == scheduler.allocator.capacity


def test_a_checkpoint_that_does_not_fit_changes_nothing(engine, checkpoint, tmp_path):
    before = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    ok, message = engine.update_weights_from_disk(str(checkpoint("tiny-qwen2")))
    assert not ok and "another model" in message and "architecture" in message
    ok, message = engine.update_weights_from_disk(str(tmp_path))
    assert not ok and "no weights in" in message
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == before


def test_update_from_tensor_changes_exactly_those_tensors_and_matches_hf(engine, first, second):
    new = load_file(str(second / "model.safetensors"))
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.norm.weight", "lm_head.weight"]
    untouched = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.embed_tokens.weight"]
    old = {n: engine.get_weights_by_name(n, 10_000) for n in names + untouched}
    # One of them as a JAX array, sharded as the caller had it.
    tensors = [(n, new[n]) for n in names[:-1]] + [(names[-1], jax.device_put(new[names[-1]]))]
    with CompileCounter() as helpers:
        assert engine.update_weights_from_tensor(tensors, weight_version="step-1") == (
            True, "updated 4 tensor(s)")
    # One layer writer per stacked shape, one layout program for the JAX array.
    assert helpers.count <= 3
    with CompileCounter() as serving:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert serving.count == 0
    for n in names:
        np.testing.assert_array_equal(engine.get_weights_by_name(n, 10_000), new[n])
    for n in untouched:
        np.testing.assert_array_equal(engine.get_weights_by_name(n, 10_000), old[n])
    assert _ids(outs) == _hf_greedy(_hf(first, {n: new[n] for n in names}), PROMPTS)
    assert outs[0]["meta_info"]["weight_version"] == "step-1"
    # A second update of the same shapes runs the helper programs already compiled.
    with CompileCounter() as again:
        assert engine.update_weights_from_tensor(
            [(n, old[n]) for n in names[:-1]] + [(names[-1], jax.device_put(old[names[-1]]))])[0]
    assert again.count == 0


def test_a_wrong_tensor_name_or_shape_changes_nothing_and_says_why(engine):
    name = "model.layers.0.mlp.down_proj.weight"
    before = engine.get_weights_by_name(name, 10_000)
    ok, message = engine.update_weights_from_tensor([
        (name, np.ones_like(before)),
        ("model.layers.0.mlp.down_proj.wieght", np.ones_like(before)),
        ("model.layers.1.mlp.down_proj.weight", np.ones((3, 4), np.float32)),
        ("model.layers.7.mlp.down_proj.weight", np.ones_like(before))])
    assert not ok
    assert "'model.layers.0.mlp.down_proj.wieght' is not a tensor of this model" in message
    assert "has shape (3, 4), the model's is (256, 512)" in message
    assert "model.layers.7.mlp.down_proj.weight" in message and "nothing was changed" in message
    np.testing.assert_array_equal(engine.get_weights_by_name(name, 10_000), before)
    with pytest.raises(ValueError, match="not a tensor of this model"):
        engine.get_weights_by_name("model.layers.0.mlp.gate.weight")


def test_get_weights_by_name_reads_the_checkpoints_layout_truncated(engine, first):
    hf = load_file(str(first / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight",
                 "model.layers.0.post_attention_layernorm.weight", "lm_head.weight"):
        got = engine.get_weights_by_name(name, truncate_size=3)
        np.testing.assert_array_equal(got, hf[name][:3])
