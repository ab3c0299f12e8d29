"""The orbax checkpoint restored straight into its shards at TP 2 and TP 4 (KV heads repeated on
the devices) gives one device's tokens; weights read back, updated from tensors and released and
resumed under tensor parallelism come back as they were."""

import numpy as np
from safetensors.numpy import load_file

from tests.support.parallel import run_driver

NAMES = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.embed_tokens.weight", "lm_head.weight"]


def test_orbax_at_tp_2_and_4_matches_one_device(orbax_llama, checkpoint, parallel_spec,
                                                llama_runs):
    runs = [{"tp_size": tp, "enable_weights_cpu_backup": True} for tp in (2, 4)]
    spec = parallel_spec(orbax_llama, runs, lifecycle=NAMES)
    hf = load_file(str(checkpoint("tiny-llama") / "model.safetensors"))
    base = llama_runs[1]["output_ids"]
    for run in run_driver(spec)["results"]:
        tp, report = run["tp_size"], run["lifecycle"]
        assert run["output_ids"] == base, tp
        assert run["compiles_after_warmup"] == 0, tp
        for name in NAMES:  # the checkpoint's layout and KV heads, whatever the sharding
            np.testing.assert_array_equal(np.array(report["read"][name], np.float32),
                                          hf[name][:4], err_msg=f"{name} at TP {tp}")
        assert report["update"] == [True, "updated 2 tensor(s)"], tp
        assert report["after_update"] == base and report["after_resume"] == base, tp
        assert report["serving_compiles"] == 0 and report["readback_equal"], tp
