"""A small model's whole engine compiled by the real TPU and GPU compilers on this CPU.

`compile_for_target` builds the runner the engine would build on that hardware (mesh over the
compile-only devices, memory planned from the chip's HBM) and compiles every program start-up
compiles: every bucket's step, every sampler, the slot initialiser, and a feature's programs
(MoE expert counts and moves, the LoRA pool's write, split prefill, block diffusion, the
speculative target's verify steps). Each must compile and report its temporaries; on TPU v6e
(Gemma on v5e's 16 GB) and H100, at TP 1 and TP 4 (a 4-chip slice). The KV cache is sized from
the compiled programs' temporaries (the plan's estimate replaced where they differ by more than
1% of the memory). Kept small (8 requests, 64-token prefills) so the module takes about a minute.
"""

import pytest

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.config import EngineArgs
from jaxrunner.runner import memory_plan
from jaxrunner.runner.compiler import Compiler
from jaxrunner.runner.model_runner import compile_for_target
from jaxrunner.speculative.plan import SpeculativePlan
from kernels_pallas.targets import H100, TPU_V5E, TPU_V6E
from models.config import ModelConfig
from models.testing.random_checkpoint import hf_config
from tests.lowering.compile_cache import skip_without_compiler

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SMALL = dict(model_path="unused", dtype="bfloat16", attention_backend="pallas",
             max_running_requests=8, max_prefill_tokens=64, context_length=1024,
             compilation_cache_dir=None, show_progress=False)
NGRAM_TARGET = SpeculativePlan(window=4, aux_layers=(), capture=False, draft_buffer=False,
                               draft_kv_bytes_per_token=0)
# (target, TP, preset, extra engine args, speculative plan): TP 1 and 4 on both targets, each
# carrying a feature's programs besides the plain ones (a runner compiles ~15 programs).
CASES = [
    (TPU_V6E, 1, "tiny-qwen3", dict(enable_split_prefill=True), None),
    (TPU_V6E, 4, "tiny-qwen3-moe", dict(ep_size=4), None),
    (TPU_V6E, 4, "tiny-sdar", dict(dllm_algorithm="LowConfidence"), None),
    (H100, 1, "tiny-llama", dict(enable_lora=True, max_lora_rank=16, lora_target_modules="all",
                                 max_loras_per_batch=4), None),
    # MoE on a GPU: the experts' grouped matmul is the Pallas GPU kernel, split over TP 4.
    (H100, 4, "tiny-qwen3-moe", {}, NGRAM_TARGET),
    # Gemma: sliding and full layers (a periodic run of two layer programs and a run of one),
    # two ropes, windows; on H100 at its head_dim of 256 with soft caps. (On TPU at head_dim
    # 128: at 256 each decode step of the engine asks XLA:TPU for more temporaries than v6e's
    # HBM (51 GB), whatever the model's layer kinds: tiny-qwen3 at head_dim 256 too.)
    # On v5e (16 GB) with mem_fraction_static 0.99: the KV cache is what the chip's memory leaves
    # after the weights and the compiled temporaries.
    (TPU_V5E, 1, "tiny-gemma3", dict(mem_fraction_static=0.99), None),
    (H100, 1, "tiny-gemma2", {}, None),
]


def _model_config(preset: str, target) -> ModelConfig:
    """The preset's config; on TPU with head_dim 128. The TPU kernel's head_dim 64 views the
    cache as packed 128-lane rows, a relayout XLA:TPU makes by copying the whole KV cache in
    every step (the compiler reports the copy: 77 GB of temporaries for a 25 GB cache on v6e),
    so a TPU engine is only planned for head_dim 128 and 256 here."""
    config = hf_config(preset, "bfloat16")
    if target.platform == "tpu":
        config = dict(config, head_dim=128)
    return ModelConfig.from_dict(config)


def _case_id(case) -> str:
    target, tp, preset, extra, speculative = case
    features = "-".join(sorted(extra)) + ("-speculative" if speculative else "")
    return f"{target.name}-tp{tp}-{preset}" + (f"-{features}" if features else "")


def _counted_compiles(monkeypatch) -> list:
    """A list that gets an entry per program compiled from now on."""
    compiles = []
    compile_one = Compiler._compile
    monkeypatch.setattr(Compiler, "_compile",
                        lambda self, lower: compiles.append(1) or compile_one(self, lower))
    return compiles


def _compiled_about_once(runner, compiles: list) -> bool:
    """Each program compiled once; where the KV cache was planned again from the compiled
    temporaries, only the largest program of each kind (and the largest sampler) before it."""
    modes = {bucket.mode for bucket in runner.buckets}
    return len(compiles) <= len(runner.compiler.reports) + len(modes) + 1


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_program_of_the_engine_compiles(case, monkeypatch):
    target, tp, preset, extra, speculative = case
    skip_without_compiler(target)
    args = EngineArgs(**SMALL, **extra, tp_size=tp)
    compiles = _counted_compiles(monkeypatch)
    runner = compile_for_target(args, _model_config(preset, target), target, num_chips=tp,
                                speculative=speculative)
    reports = runner.compiler.reports
    assert _compiled_about_once(runner, compiles)
    failed = {name: r.error for name, r in reports.items() if not r.ok}
    assert not failed
    steps = [name for name in reports if name.startswith("step ")]
    assert len(steps) == len(runner.buckets)
    assert any(name.startswith("sample ") for name in reports)
    # The steps' temporaries are reported (the attention and MLP activations at least).
    assert all(reports[name].temp_bytes > 0 for name in steps)
    # The memory plan is the chip's: the KV cache sized from its HBM, less the weights and the
    # compiled programs' temporaries.
    memory = runner.run_plan.memory
    assert memory.budget is not None
    assert abs(memory.program_temp - runner.compiler.max_temp_bytes) <= 0.01 * target.hbm_bytes()
    assert runner.max_total_tokens > 0
    if tp == 1:
        # The weights and the KV cache take at most mem_fraction_static of the memory, and the
        # programs' temporaries fit beside them with the 3% margin.
        kv_bytes = memory.max_total_tokens * memory.kv_bytes_per_token  # the dummy page aside
        assert runner.weights_bytes + kv_bytes <= args.mem_fraction_static * target.hbm_bytes()
        assert (runner.weights_bytes + kv_bytes + memory.program_temp
                <= 0.97 * target.hbm_bytes())
    if speculative is not None:
        assert any(b.mode == ForwardMode.TARGET_VERIFY for b in runner.buckets)
    if preset.endswith("-moe"):
        assert runner.moe_runner.grouped_matmul == ("triton" if target.platform == "cuda"
                                                    else "ragged_dot")



def test_a_wrong_estimate_of_temporaries_is_corrected_before_the_programs_compile(monkeypatch):
    """The estimate of the programs' temporaries 2 GiB too large: the KV cache is planned again
    from the largest programs' compiled temporaries before the others compile (so each
    program compiles once, not once per plan), and keeps aside what the compiler reported."""
    skip_without_compiler(H100)
    monkeypatch.setattr(memory_plan, "estimate_program_temp", lambda *args: 2 * 2**30)
    compiles = _counted_compiles(monkeypatch)
    args = EngineArgs(**dict(SMALL, max_running_requests=2, max_prefill_tokens=32))
    runner = compile_for_target(args, _model_config("tiny-llama", H100), H100, num_chips=1)
    memory = runner.run_plan.memory
    assert memory.program_temp < 2**30
    assert abs(memory.program_temp - runner.compiler.max_temp_bytes) <= 0.01 * H100.hbm_bytes()
    assert _compiled_about_once(runner, compiles)
