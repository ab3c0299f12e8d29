"""LoRA under tensor parallelism on simulated CPU devices: A and B sharded as their base
projections (B's output features for q/k/v/gate/up, A's input features for o/down; at TP 4
tiny-llama's 2 KV heads are repeated, and k/v's B with them) give the tokens of one device, for
a batch mixing the base and two adapters, with no compile after warm-up."""

from models.testing.random_lora import make_lora_adapter
from tests.support.parallel import PARALLEL_PROMPTS, run_driver

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_lora_tp_matches_one_device(checkpoint, parallel_spec, tmp_path):
    base = checkpoint("tiny-llama")
    attn = make_lora_adapter(base, tmp_path / "attn", rank=8, target_modules=ALL[:4], seed=1)
    every = make_lora_adapter(base, tmp_path / "all", rank=16, target_modules=ALL, seed=2,
                              use_rslora=True)
    lora = dict(lora_paths=f"attn={attn},all={every}", max_loras_per_batch=2)
    runs = [dict(lora, tp_size=tp) for tp in (1, 2, 4)]
    spec = parallel_spec(base, runs, lora_path=["attn", None, "all", "all"][:len(PARALLEL_PROMPTS)])
    one, *sharded = run_driver(spec)["results"]
    assert one["compiles_after_warmup"] == 0
    for run in sharded:
        assert run["output_ids"] == one["output_ids"], run["tp_size"]
        assert run["compiles_after_warmup"] == 0, run["tp_size"]
