"""Multi-LoRA serving on tiny-qwen3 against PEFT (a module of its own: an engine's compile
monitor forbids compiles while it lives, so two engines must not overlap)."""

from jaxrunner import Engine
from models.testing.random_lora import make_lora_adapter
from tests.support.lora import ALL, ATTN, PeftReference, check_against_peft, lora_prompts
from tests.support.presets import LORA_ENGINE


def test_qwen3_mixed_batch_matches_peft(checkpoint, engine_kwargs, tmp_path_factory):
    """tiny-qwen3 (q/k norms, tied embeddings, 8 query heads over 2 KV heads): rank 8 on
    attention and rank 16 on every projection, against PEFT in one mixed batch; the pool's
    modules and rank come from the start-up adapters."""
    base = checkpoint("tiny-qwen3")
    root = tmp_path_factory.mktemp("lora_qwen3")
    paths = {"r8": make_lora_adapter(base, root / "r8", rank=8, target_modules=ATTN, seed=6),
             "r16": make_lora_adapter(base, root / "r16", rank=16, target_modules=ALL, seed=7)}
    kwargs = {k: v for k, v in LORA_ENGINE.items() if k != "max_lora_rank"}
    engine = Engine(model_path=str(base), **dict(
        engine_kwargs, **kwargs, lora_paths=",".join(f"{k}={v}" for k, v in paths.items())))
    try:
        assert engine.args.lora_target_modules == ",".join(ALL)
        assert engine.args.max_lora_rank == 16
        ref = PeftReference(base, paths)
        prompts = lora_prompts(engine.model_config.vocab_size, seed=3)
        names = [["r16", None, "r8"][i % 3] for i in range(len(prompts))]
        check_against_peft(engine, ref, prompts, names)
        assert engine.compile_monitor.count == engine.runner.warm_compile_count
    finally:
        engine.shutdown()
