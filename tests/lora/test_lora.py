"""Multi-LoRA serving against PEFT (torch) on the same random adapters, written by PEFT itself:
mixed batches of base and adapter requests, more adapters than device slots (LRU swaps), loads
and unloads while serving, the prefix cache keyed by adapter, and bad adapters named. Every
engine runs with disallow_compile_after_warmup: a swap or load that compiled would raise."""

import dataclasses
import json
import shutil

import jax
import pytest

from jaxrunner import Engine
from models.testing.random_lora import make_lora_adapter
from tests.support.engine import assert_no_kv_cache_copy
from tests.support.lora import ALL, ATTN, MAX_NEW, PeftReference, check_against_peft, lora_prompts
from tests.support.presets import LORA_ENGINE


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    base = checkpoint("tiny-llama")
    root = tmp_path_factory.mktemp("lora")
    return base, {
        "attn8": make_lora_adapter(base, root / "attn8", rank=8, target_modules=ATTN, seed=1),
        "all16": make_lora_adapter(base, root / "all16", rank=16, target_modules=ALL,
                                   use_rslora=True, seed=2),
        "all8": make_lora_adapter(base, root / "all8", rank=8, target_modules=ALL, seed=3),
        "attn16": make_lora_adapter(base, root / "attn16", rank=16, target_modules=ATTN, seed=4),
        "rank32": make_lora_adapter(base, root / "rank32", rank=32, target_modules=ATTN, seed=5),
    }


@pytest.fixture(scope="module")
def lora_engine(adapters, engine_kwargs):
    base, paths = adapters
    engine = Engine(model_path=str(base), **dict(
        engine_kwargs, **LORA_ENGINE, lora_target_modules="all",
        lora_paths={"attn8": str(paths["attn8"]), "all16": str(paths["all16"])}))
    ref = PeftReference(base, {k: v for k, v in paths.items() if k != "rank32"})
    yield engine, ref, paths
    engine.shutdown()


def test_mixed_batch_matches_peft(lora_engine):
    engine, ref, _ = lora_engine
    prompts = lora_prompts(engine.model_config.vocab_size)
    names = [[None, "attn8", "all16"][i % 3] for i in range(len(prompts))]
    outs = check_against_peft(engine, ref, prompts, names)
    # The adapters change the tokens (else the comparison above would prove little).
    base = [ref.generate(p, None) for p in prompts]
    for name in ("attn8", "all16"):
        assert any(o["output_ids"] != b for o, b, n in zip(outs, base, names) if n == name)
    assert engine.compile_monitor.count == engine.runner.warm_compile_count


def test_no_copy_of_the_kv_cache_or_the_adapter_pool(lora_engine):
    engine = lora_engine[0]
    assert_no_kv_cache_copy(engine.runner)
    pool = engine.runner.lora_pool
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(pool.arrays))
    # A swap writes its slot into the donated pool in place.
    assert pool.write_executable.memory_analysis().alias_size_in_bytes >= pool_bytes


def test_more_adapters_than_slots_load_and_unload(lora_engine):
    engine, ref, paths = lora_engine
    registry = engine.lora_registry
    engine.load_lora_adapter("all8", str(paths["all8"]))
    engine.load_lora_adapter("attn16", str(paths["attn16"]))
    evictions = registry.num_evictions
    prompts = lora_prompts(engine.model_config.vocab_size, seed=1)
    names = [[None, "attn8", "all16", "all8", "attn16"][i % 5] for i in range(len(prompts))]
    check_against_peft(engine, ref, prompts, names)
    assert registry.num_evictions > evictions  # four adapters through two slots
    assert registry.pins == [0, 0]
    # Unloaded: refused by name, and the engine keeps serving the others.
    assert engine.unload_lora_adapter("all8")["loaded_adapters"].keys() == {
        "attn8", "all16", "attn16"}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all8'"):
        engine.generate(input_ids=prompts[0], lora_path="all8")
    check_against_peft(engine, ref, prompts[:3], ["attn16", None, "attn8"])
    assert engine.compile_monitor.count == engine.runner.warm_compile_count


def test_prefix_cache_is_keyed_by_adapter(lora_engine):
    engine, ref, _ = lora_engine
    prompt = lora_prompts(engine.model_config.vocab_size, lens=[40], seed=2)[0]  # 2 whole pages
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    first = engine.generate(input_ids=prompt, lora_path="attn8", sampling_params=params)
    again = engine.generate(input_ids=prompt, lora_path="attn8", sampling_params=params)
    assert again["meta_info"]["cached_tokens"] == 32
    assert again["output_ids"] == first["output_ids"]
    for other in ("all16", None):
        out = engine.generate(input_ids=prompt, lora_path=other, sampling_params=params)
        assert out["meta_info"]["cached_tokens"] == 0, other
        assert out["output_ids"] == ref.generate(prompt, other), other


def test_bad_adapters_are_named(lora_engine, tmp_path):
    engine, ref, paths = lora_engine
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.generate(input_ids=[1, 2, 3], lora_path="nope")
    with pytest.raises(ValueError, match="rank 32, above the engine's max_lora_rank=16"):
        engine.load_lora_adapter("big", str(paths["rank32"]))
    lacking = shutil.copytree(paths["attn8"], tmp_path / "lacking")
    config = json.loads((lacking / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "w_proj"]
    (lacking / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target modules \['w_proj'\] are not modules"):
        engine.load_lora_adapter("lacking", str(lacking))
    corrupt = shutil.copytree(paths["attn8"], tmp_path / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="adapter_model.safetensors is corrupt"):
        engine.load_lora_adapter("corrupt", str(corrupt))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("attn8", str(paths["attn8"]))
    assert "big" not in engine.loaded_lora_adapters()
    # Still serving, with no compile.
    check_against_peft(engine, ref, [[5, 6, 7]], ["all16"])
    assert engine.compile_monitor.count == engine.runner.warm_compile_count


def test_lora_settings_are_checked(checkpoint, adapters):
    base, paths = adapters
    with pytest.raises(ValueError, match="needs max_lora_rank"):
        Engine(model_path=str(base), enable_lora=True, lora_target_modules="all")
    with pytest.raises(ValueError, match=r"lora_target_modules \['lm_head'\]"):
        Engine(model_path=str(base), enable_lora=True, max_lora_rank=8,
               lora_target_modules="q_proj,lm_head")
    with pytest.raises(ValueError, match="LoRA is not implemented with speculative decoding"):
        Engine(model_path=str(base), lora_paths=f"a={paths['attn8']}",
               speculative_algorithm="NGRAM")


def test_http_routes(lora_engine):
    """/generate's lora_path, the OpenAI routes' model="base:adapter" or the adapter's name,
    /v1/models listing the adapters, /load_lora_adapter and /unload_lora_adapter, and 400/404
    for unknown adapters, with the engine still serving (the app runs in-process on the
    module's engine)."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from jaxrunner.server.app import build_app

    engine, ref, paths = lora_engine
    prompt = [11, 12, 13, 14, 15]
    want = {name: ref.generate(prompt, name) for name in (None, "attn8", "all16", "attn16")}
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    with TestClient(build_app(engine, "base")) as client:
        r = client.post("/generate", json={"input_ids": [prompt, prompt, prompt],
                                           "lora_path": ["attn8", None, "all16"],
                                           "sampling_params": params})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == [want["attn8"], want[None], want["all16"]]
        for model, name in (("base:all16", "all16"), ("attn8", "attn8"), ("base", None)):
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                     "max_tokens": MAX_NEW, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert r.json()["usage"]["completion_tokens"] == len(want[name])
            assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(
                want[name], skip_special_tokens=True)
        ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
        assert {"base", "base:attn8", "base:all16"} <= ids
        r = client.post("/v1/completions", json={"model": "base:nope", "prompt": prompt})
        assert r.status_code == 404 and "base:nope" in r.json()["error"]["message"]
        r = client.post("/generate", json={"input_ids": prompt, "lora_path": "nope"})
        assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.text
        r = client.post("/unload_lora_adapter", json={"lora_name": "attn16"})
        assert r.status_code == 200 and "attn16" not in r.json()["loaded_adapters"]
        r = client.post("/load_lora_adapter", json={"lora_name": "big",
                                                    "lora_path": str(paths["rank32"])})
        assert r.status_code == 400 and not r.json()["success"]
        assert "max_lora_rank" in r.json()["error_message"]
        r = client.post("/load_lora_adapter", json={"lora_name": "attn16",
                                                    "lora_path": str(paths["attn16"])})
        assert r.status_code == 200 and "attn16" in r.json()["loaded_adapters"], r.text
        r = client.post("/generate", json={"input_ids": prompt, "lora_path": "attn16",
                                           "sampling_params": params})
        assert r.json()["output_ids"] == want["attn16"]
    assert engine.compile_monitor.count == engine.runner.warm_compile_count


def test_registry_pins_waits_and_evicts_least_recently_used():
    from jaxrunner.lora.adapter import LoraAdapter
    from jaxrunner.lora.registry import LoraRegistry

    writes = []
    registry = LoraRegistry(None, num_slots=2, max_rank=8, target_modules=tuple(ATTN),
                            write_slot=lambda slot, a: writes.append((slot, a.name)))
    a, b, c = (LoraAdapter(n, n, uid, 8, 1.0, {}) for uid, n in enumerate("abc"))
    assert (registry.acquire(a), registry.acquire(b)) == (0, 1)
    assert registry.acquire(c) is None  # both slots pinned: c's request waits
    registry.release(0)
    assert registry.acquire(c) == 0 and registry.num_evictions == 1  # a was unpinned
    registry.release(1)  # b: unpinned first, so least recently used
    registry.release(0)
    assert registry.acquire(a) == 1  # b's slot
    assert registry.acquire(c) == 0  # still resident: no copy
    assert writes == [(0, "a"), (1, "b"), (0, "c"), (1, "a")]
    assert registry.num_swaps == 4 and registry.num_evictions == 2 and registry.pins == [1, 1]
    with pytest.raises(RuntimeError, match="released more often"):
        registry.release(0), registry.release(0)


def test_registry_refuses_modules_outside_the_pool_and_moe_mlps(adapters):
    from jaxrunner.lora.adapter import LoraAdapterError, read_adapter
    from jaxrunner.lora.registry import LoraRegistry
    from models.config import ModelConfig

    base, paths = adapters
    cfg = ModelConfig.from_pretrained(base)
    registry = LoraRegistry(cfg, num_slots=2, max_rank=16, target_modules=tuple(ATTN),
                            write_slot=lambda slot, adapter: None)
    with pytest.raises(LoraAdapterError, match=r"targets \['gate_proj', 'up_proj', 'down_proj'\]"
                                                r", outside the engine's lora_target_modules"):
        registry.load("all8", str(paths["all8"]))
    assert registry.load("attn8", str(paths["attn8"])).target_modules == tuple(ATTN)
    # A MoE model's experts are not dense projections: an MLP adapter is refused by name.
    moe = dataclasses.replace(cfg, num_experts=8, num_experts_per_tok=2)
    assert moe.is_moe
    with pytest.raises(LoraAdapterError, match=r"target modules \['down_proj', 'gate_proj', "
                                                r"'up_proj'\] are not modules of this model"):
        read_adapter("all8", paths["all8"], moe, uid=0)
