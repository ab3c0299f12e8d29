"""Weight updates for every model kind (jaxrunner/runner/model_weights.py): a MoE model's experts
by their Hugging Face names, per expert or fused, written to every slot of their expert under an
EPLB placement with copies; weights quantized on load, quantized again from the float tensors
an update brings. For both: release -> resume without a backup -> requests refused -> update
from disk -> the tokens of a fresh load (Hugging Face's, for the float MoE model). Expert
parallelism and pre-quantized checkpoints: tests/parallel/test_expert_parallel.py,
test_quantized_tp.py and tests/models/quantization/test_quantization_formats.py."""

from flax import nnx
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrunner import Engine
from jaxrunner.engine.lifecycle import EngineNotReadyError
from models.quantization.linear import QuantConfig, dequantize, quantize_weight
from models.testing.random_checkpoint import cached_checkpoint
from tests.support.parity import hf_greedy_tokens

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 20]
# The experts of each MoE layer over 10 slots: moved, experts 3 and 7 (layer 1: 0 and 5) twice.
PLACEMENT = [[3, 3, 7, 1, 0, 2, 4, 5, 6, 7], [5, 0, 1, 2, 0, 3, 4, 5, 6, 7]]
# Few buckets: 4 decode rows, 64-token prefills.
SMALL = dict(max_running_requests=4, max_prefill_tokens=64, max_total_tokens=4096)
EXPERT = "model.layers.{layer}.mlp.experts.{e}.{leaf}.weight"


def _ids(outs):
    return [o["output_ids"] for o in outs]


def _tensors(path) -> dict[str, np.ndarray]:
    return load_file(str(path / "model.safetensors"))


def _fused(tensors: dict, layers, num_experts: int) -> dict[str, np.ndarray]:
    """The per-expert tensors as transformers 5 holds them: gate_up_proj [E, 2I, D] and
    down_proj [E, D, I] per layer; every other tensor as it is."""
    fused = {n: t for n, t in tensors.items() if ".experts." not in n}
    for layer in layers:
        def stack(leaf):
            return np.stack([tensors[EXPERT.format(layer=layer, e=e, leaf=leaf)]
                             for e in range(num_experts)])
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")],
                                                         axis=1)
        fused[f"{prefix}.down_proj"] = stack("down_proj")
    return fused


@pytest.fixture(scope="module")
def moe_paths(checkpoint, checkpoint_root):
    return checkpoint("tiny-qwen3-moe"), cached_checkpoint(
        "tiny-qwen3-moe", checkpoint_root / "seed-1", seed=1)


@pytest.fixture(scope="module")
def moe_engine(moe_paths, engine_kwargs):
    """tiny-qwen3-moe with 2 redundant expert slots, its experts moved and copied as an EPLB
    rebalance moves them (on one device a rebalance finds no busier rank to relieve), so a slot
    no longer holds expert `slot mod E`."""
    engine = Engine(model_path=str(moe_paths[0]), ep_num_redundant_experts=2,
                    **dict(engine_kwargs, **SMALL))
    assert engine.runner.set_expert_placement(np.array(PLACEMENT)) > 0
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def moe_greedy(moe_paths):
    """Hugging Face's tokens on each checkpoint: what the engine must serve after an update."""
    return [hf_greedy_tokens(path, PROMPTS, GREEDY["max_new_tokens"]) for path in moe_paths]


def test_moe_update_from_tensors_per_expert_and_fused_equals_a_fresh_load(
        moe_engine, moe_paths, moe_greedy):
    first, second = moe_paths
    assert moe_greedy[0] != moe_greedy[1]
    assert _ids(moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == moe_greedy[0]
    warm = moe_engine.compile_monitor.count
    ok, message = moe_engine.update_weights_from_tensor(list(_tensors(second).items()))
    assert ok, message
    assert _ids(moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == moe_greedy[1]
    # transformers 5's fused names, from the first checkpoint's tensors.
    fused = _fused(_tensors(first), moe_engine.model_config.moe_layers, 8)
    ok, message = moe_engine.update_weights_from_tensor(fused)
    assert ok, message
    assert _ids(moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == moe_greedy[0]
    assert moe_engine.compile_monitor.count == warm  # serving steps: none compiled


def test_moe_partial_update_writes_every_copy_of_an_expert(moe_engine, moe_paths):
    """One expert of one layer, which the rebalance copied: each of its slots takes the new
    weights, and reading it back gives them; the other experts keep theirs."""
    first, second = moe_paths
    placement = moe_engine.runner.expert_location.physical_to_logical
    row = placement[0]
    copied = int(np.bincount(row).argmax())
    layer = moe_engine.model_config.moe_layers[0]
    name = EXPERT.format(layer=layer, e=copied, leaf="down_proj")
    other = EXPERT.format(layer=layer, e=(copied + 1) % 8, leaf="down_proj")
    new = _tensors(second)[name]
    assert moe_engine.update_weights_from_tensor({name: new}, flush_cache=False)[0]
    flat = dict(nnx.to_flat_state(moe_engine.runner.state))
    down = np.asarray(flat[("model", "layers", 1, "mlp", "experts", "down_proj")].get_value())
    for slot in np.flatnonzero(row == copied):
        np.testing.assert_array_equal(down[0, slot], new.T)
    np.testing.assert_array_equal(moe_engine.get_weights_by_name(name, 10**6), new)
    np.testing.assert_array_equal(moe_engine.get_weights_by_name(other, 10**6),
                                  _tensors(first)[other])
    fused_name = f"model.layers.{layer}.mlp.experts.down_proj"
    fused = moe_engine.get_weights_by_name(fused_name, 10**6)
    np.testing.assert_array_equal(fused[copied], new)
    assert moe_engine.update_weights_from_disk(str(first))[0]


def test_moe_release_resume_refuses_until_updated_from_disk(moe_engine, moe_paths, moe_greedy):
    moe_engine.release_memory_occupation()
    moe_engine.resume_memory_occupation()
    with pytest.raises(EngineNotReadyError, match="hold no weights.*update_weights_from_disk"):
        moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    # Some tensors are not all: still refused, naming what is missing.
    some = {n: t for n, t in _tensors(moe_paths[0]).items() if ".experts." not in n}
    assert moe_engine.update_weights_from_tensor(some)[0]
    with pytest.raises(EngineNotReadyError, match=r"experts\.\d+\."):
        moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert moe_engine.update_weights_from_disk(str(moe_paths[0]))[0]
    assert _ids(moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == moe_greedy[0]


def test_moe_bad_updates_change_nothing_and_say_why(moe_engine, moe_greedy):
    name = EXPERT.format(layer=1, e=0, leaf="gate_proj")
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    cases = {
        "model.layers.1.mlp.experts.8.gate_proj.weight": "not a tensor of this model",
        name: "has shape",
        fused: "has shape",
    }
    for bad, why in cases.items():
        ok, message = moe_engine.update_weights_from_tensor(
            [(EXPERT.format(layer=2, e=1, leaf="up_proj"), np.zeros((128, 256), np.float32)),
             (bad, np.zeros((3, 3), np.float32))])
        assert not ok and why in message and "nothing was changed" in message, message
    zeros = np.zeros((128, 256), np.float32)
    ok, message = moe_engine.update_weights_from_tensor(
        [(name, zeros), (fused, np.zeros((8, 256, 256), np.float32))])
    assert not ok and "given twice" in message, message
    assert _ids(moe_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == moe_greedy[0]


# ---- weights quantized on load ----

@pytest.fixture(scope="module")
def int8_llama(checkpoint, checkpoint_root, engine_kwargs):
    first = checkpoint("tiny-llama")
    second = cached_checkpoint("tiny-llama", checkpoint_root / "seed-1", seed=1)
    engine = Engine(model_path=str(first), quantization="int8", **dict(engine_kwargs, **SMALL))
    yield engine, first, second
    engine.shutdown()


def test_int8_updates_quantize_again_and_release_resume_refuses_until_refilled(int8_llama):
    engine, first, second = int8_llama
    before = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert engine.update_weights_from_disk(str(second))[0]
    from_disk = _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert from_disk != before
    # The first checkpoint's float tensors, quantized again as at load.
    ok, message = engine.update_weights_from_tensor(list(_tensors(first).items()))
    assert ok, message
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == before
    name = "model.layers.1.self_attn.k_proj.weight"
    w = _tensors(first)[name]
    quant = QuantConfig("int8")
    want = dequantize(*quantize_weight(w.T, quant), quant).T
    np.testing.assert_allclose(engine.get_weights_by_name(name, 10**6), want, rtol=1e-6)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    with pytest.raises(EngineNotReadyError, match="hold no weights"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert engine.update_weights_from_disk(str(second))[0]
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == from_disk
