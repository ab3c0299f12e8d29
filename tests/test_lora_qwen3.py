"""Multi-LoRA serving on tiny-qwen3 against PEFT (a module of its own: an engine's compile
monitor forbids compiles while it lives, so two engines must not overlap)."""

import pytest

from jaxrunner import Engine
from models.random_lora import make_lora_adapter
from tests.test_lora import ALL, ATTN, LORA_ENGINE, PeftReference, _check_against_peft, _prompts


def test_qwen3_attention_pool(checkpoint, engine_kwargs, tmp_path_factory):
    """tiny-qwen3 (q/k norms, tied embeddings, 8 query heads), a pool of attention modules
    only: ranks 8 and 16 against PEFT in one mixed batch; an adapter on the MLP is refused."""
    base = checkpoint("tiny-qwen3")
    root = tmp_path_factory.mktemp("lora_qwen3")
    paths = {"r8": make_lora_adapter(base, root / "r8", rank=8, target_modules=ATTN, seed=6),
             "r16": make_lora_adapter(base, root / "r16", rank=16,
                                      target_modules=["q_proj", "v_proj"], seed=7)}
    mlp = make_lora_adapter(base, root / "mlp", rank=8, target_modules=ALL, seed=8)
    engine = Engine(model_path=str(base), **dict(
        engine_kwargs, **LORA_ENGINE, lora_paths=",".join(f"{k}={v}" for k, v in paths.items())))
    try:
        assert engine.args.lora_target_modules == "q_proj,k_proj,v_proj,o_proj"
        ref = PeftReference(base, paths)
        prompts = _prompts(engine.model_config.vocab_size, seed=3)
        names = [["r16", None, "r8"][i % 3] for i in range(len(prompts))]
        _check_against_peft(engine, ref, prompts, names)
        with pytest.raises(ValueError, match="outside the engine's lora_target_modules"):
            engine.load_lora_adapter("mlp", str(mlp))
        assert engine.compile_monitor.count == engine.runner.warm_compile_count
    finally:
        engine.shutdown()
