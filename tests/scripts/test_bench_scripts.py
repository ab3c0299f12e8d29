"""The benchmark scripts run end to end on the tiny Llama with tiny settings and report sane
numbers; the FLOP accounting they rest on matches a token-by-token count.

Smoke tests, not timings: they check the JSON's fields and their relations, never speed.
"""

import json
from pathlib import Path
import sys

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_ab  # noqa: E402
import bench_attention  # noqa: E402
import bench_common  # noqa: E402
import bench_moe  # noqa: E402
import bench_offline_throughput  # noqa: E402
import bench_one_batch  # noqa: E402
import bench_speculative  # noqa: E402
import plot_one_batch  # noqa: E402
import profile_step  # noqa: E402

TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64,
            vocab=1024)


def test_request_flops_counts_every_token_at_its_context():
    shapes = bench_common.ModelShapes(**TINY)
    prompt, out, cached = 20, 5, 8
    per_token = 2 * shapes.layer_params
    # Positions cached .. prompt+out-2 run through the layers; position p attends p + 1 keys.
    positions = range(cached, prompt + out - 1)
    want_layers = per_token * len(positions)
    want_attn = sum(4 * shapes.layers * shapes.heads * shapes.head_dim * (p + 1)
                    for p in positions)
    got = shapes.request_flops(prompt, out, cached=cached)
    assert got.layers == want_layers
    assert got.attention == want_attn
    assert got.lm_head == 2 * shapes.hidden * shapes.vocab * out
    # Per layer: q, o 256x256; k, v 256x128; gate, up 256x512, down 512x256.
    assert shapes.layer_params == 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)


def test_shared_prefix_workload_shares_exactly_the_prefix():
    w = bench_offline_throughput.shared_prefix_workload(
        num_groups=3, prompts_per_group=2, prefix_len=16, suffix_len=4, output_len=(2, 5),
        vocab_size=1024, seed=0)
    assert len(w.prompts) == 6 and all(len(p) == 20 for p in w.prompts)
    assert all(2 <= n <= 5 for n in w.output_lens)
    for i, p in enumerate(w.prompts):
        assert p[:16] == w.prompts[i % 3][:16]
        assert w.shared_prefix_lens[i] == (0 if i < 3 else 16)
    assert w.prompts[0][:16] != w.prompts[1][:16]


def _common_flags(checkpoint, compilation_cache_dir):
    return ["--model-path", str(checkpoint("tiny-llama")), "--page-size", "16",
            "--compilation-cache-dir", compilation_cache_dir, "--probe-reps", "1"]


def test_bench_attention_flops_count_the_keys_each_token_sees():
    args = bench_attention.parse_args(["--num-kv-heads", "2", "--group", "3", "--head-dim", "8"])
    # A 3-token extend over 5 cached + 3 new keys sees 6, 7, 8 keys; a decode over 4 sees 4.
    scenario = bench_attention.Scenario("x", ((3, 8), (1, 4)))
    assert bench_attention.attention_flops(scenario, args) == 4 * (6 + 7 + 8 + 4) * 2 * 3 * 8
    args.sliding_window = 5
    assert bench_attention.attention_flops(scenario, args) == 4 * (5 + 5 + 5 + 4) * 2 * 3 * 8


def test_bench_attention_times_each_cpu_build(tmp_path):
    import kernels_cpu
    builds = ["native", *kernels_cpu.runnable_levels()[:1]]  # the baseline level where runnable
    out = tmp_path / "attention.json"
    bench_attention.main(["--scenarios", "decode", "prefill", "--backends", "cpu", "reference",
                          "--cpu-builds", *builds, "--decode-seqs", "3", "--decode-kv-len", "40",
                          "--prefill-len", "16", "--head-dim", "64", "--iters", "1",
                          "--bandwidth-bytes", str(1 << 20), "--json-out", str(out)])
    records = json.loads(out.read_text())
    runs = {(r["scenario"], r["backend"], r["cpu_build"]) for r in records}
    assert runs == {(s, "cpu", b) for s in ("decode", "prefill") for b in builds} | {
        ("decode", "reference", None), ("prefill", "reference", None)}
    for r in records:
        assert r["read_fraction"] > 0 and r["gflops_per_s"] > 0
        assert r["gflops_per_s"] == pytest.approx(r["flops"] / r["median_ms"] / 1e6)


def test_faster_rates_keep_each_row_counts_faster_probe():
    def probe(layers_s, head_s):
        rows = [{"rows": m, "layers_matmul_s": l, "lm_head_s": h,
                 "layers_flops_per_s": 1 / l, "lm_head_flops_per_s": 1 / h}
                for m, l, h in zip((64, 512), layers_s, head_s)]
        return {"dtype": "float32", "per_rows": rows,
                "layers_flops_per_s": max(r["layers_flops_per_s"] for r in rows),
                "lm_head_flops_per_s": max(r["lm_head_flops_per_s"] for r in rows)}

    before, after = probe((2.0, 4.0), (1.0, 8.0)), probe((3.0, 2.5), (0.5, 9.0))
    rates = bench_common.faster_rates(before, after)
    assert [(r["layers_matmul_s"], r["lm_head_s"]) for r in rates["per_rows"]] == [(2.0, 0.5),
                                                                                  (2.5, 8.0)]
    assert rates["per_rows"][1]["layers_flops_per_s"] == 0.4
    assert rates["layers_flops_per_s"] == 0.5 and rates["lm_head_flops_per_s"] == 2.0
    assert rates["drift"] == {"layers_flops_per_s_before": 0.5, "layers_flops_per_s_after": 0.4}


def test_bench_offline_throughput_with_hf_baseline(checkpoint, compilation_cache_dir, tmp_path,
                                                  capsys):
    out = tmp_path / "offline.json"
    result = bench_offline_throughput.main(
        _common_flags(checkpoint, compilation_cache_dir)
        + ["--num-prompts", "6", "--input-len", "8", "40", "--output-len", "2", "6",
           "--max-running-requests", "8", "--max-prefill-tokens", "64",
           "--baseline", "hf", "--hf-batch-sizes", "16", "4", "--json-out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    printed = capsys.readouterr().out
    assert "ours / HF" in printed and "achieved / floor" in printed
    assert result["num_prompts"] == 6 and result["compiles_after_warmup"] == 0
    assert 6 * 2 <= result["output_tokens"] <= 6 * 6
    assert result["elapsed_s"] > 0
    assert result["total_throughput"] == pytest.approx(
        (result["input_tokens"] + result["output_tokens"]) / result["elapsed_s"])
    flops = result["useful_flops"]
    assert flops["total"] == pytest.approx(flops["layers"] + flops["attention"] + flops["lm_head"])
    assert result["useful_flops_without_prefix_reuse"] == flops["total"]  # random: no sharing
    assert result["matmul_rates"]["layers_flops_per_s"] > 0
    assert 0 < result["compute_floor_s"] < result["elapsed_s"]
    assert result["floor_fraction"] == pytest.approx(result["compute_floor_s"]
                                                     / result["elapsed_s"])
    runs = result["hf_runs"]
    assert [r["batch_size"] for r in runs] == [16, 4] and all(r["elapsed_s"] > 0 for r in runs)
    hf = result["hf"]
    assert hf == min(runs, key=lambda r: r["elapsed_s"])  # the speed-up is against the fastest
    assert "HF duration, batch 4 (s)" in printed
    assert hf["output_throughput"] == pytest.approx(result["output_tokens"] / hf["elapsed_s"])
    assert result["speedup_vs_hf"] == pytest.approx(hf["elapsed_s"] / result["elapsed_s"])


def test_bench_ab_takes_turns_and_compares_tokens(checkpoint, compilation_cache_dir, capsys):
    base = {"dtype": "float32", "max_running_requests": 4, "max_prefill_tokens": 64,
            "max_total_tokens": 2048, "compilation_cache_dir": compilation_cache_dir}
    result = bench_ab.main(
        ["--model-path", str(checkpoint("tiny-llama")), "--variant", json.dumps(base),
         "--variant", json.dumps(dict(base, disable_overlap_schedule=True)), "--rounds", "2",
         "--num-prompts", "3", "--input-len", "4", "40", "--output-len", "2", "5"])
    first, second = result["variants"]
    assert second["engine_args"]["disable_overlap_schedule"] is True
    for v in (first, second):
        assert len(v["times_s"]) == 2 and all(t > 0 for t in v["times_s"])
        assert v["min_s"] <= v["median_s"] <= v["max_s"]
        assert v["compiles_after_warmup"] == 0
        # Overlap or not, greedy decoding gives the same tokens, round by round.
        assert v["same_tokens_as_first"] == [True, True]
    assert first["median_vs_first"] == 1.0
    assert second["median_vs_first"] == pytest.approx(second["median_s"] / first["median_s"])
    assert "median / first" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_ab.parse_args(["--variant", "{}"])  # one variant compares nothing


def test_bench_offline_throughput_shared_prefix(checkpoint, compilation_cache_dir):
    result = bench_offline_throughput.main(
        _common_flags(checkpoint, compilation_cache_dir)
        + ["--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2",
           "--prefix-len", "32", "--suffix-len", "4", "--output-len", "3", "3",
           "--max-running-requests", "4", "--max-prefill-tokens", "64"])
    assert result["workload"] == "shared-prefix"
    assert result["num_prompts"] == 4 and result["input_tokens"] == 4 * 36
    assert result["output_tokens"] == 4 * 3
    # The two later prompts of each group need not recompute the 32-token prefix.
    assert result["useful_flops"]["total"] < result["useful_flops_without_prefix_reuse"]
    assert result["compute_floor_s"] < result["compute_floor_without_prefix_reuse_s"]
    assert 0 <= result["cached_tokens"] <= 2 * 32  # at most the later prompts' prefixes


def test_bench_offline_throughput_runs_dummy_weights_from_a_config_alone(
        checkpoint, compilation_cache_dir, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint("tiny-llama") / "config.json").read_text())
    flags = _common_flags(checkpoint, compilation_cache_dir)
    flags[1] = str(tmp_path)  # --model-path: config.json and nothing else
    result = bench_offline_throughput.main(
        flags + ["--load-format", "dummy", "--num-prompts", "2", "--input-len", "8", "16",
                 "--output-len", "2", "3", "--max-running-requests", "4",
                 "--max-prefill-tokens", "32"])
    assert result["load_format"] == "dummy" and result["compiles_after_warmup"] == 0
    assert result["num_prompts"] == 2 and 4 <= result["output_tokens"] <= 6
    with pytest.raises(SystemExit):  # dummy weights have no checkpoint to compare with
        bench_offline_throughput.parse_args(flags + ["--load-format", "dummy",
                                                     "--baseline", "hf"])


@pytest.fixture(scope="module")
def one_batch_json(checkpoint, compilation_cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_batch") / "one_batch.json"
    result = bench_one_batch.main(
        _common_flags(checkpoint, compilation_cache_dir)
        + ["--batch-sizes", "4", "1", "2", "--input-len", "24", "--output-len", "5",
           "--max-prefill-tokens", "64", "--json-out", str(out)])
    return result, out


def test_bench_one_batch(one_batch_json):
    result, out = one_batch_json
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["compiles_after_warmup"] == 0
    assert [b["batch_size"] for b in result["batches"]] == [1, 2, 4]
    assert result["skipped_batch_sizes"] == []
    assert result["memory_bandwidth"]["bytes_per_s"] > 0
    for b in result["batches"]:
        assert b["decode_bucket"] >= b["batch_size"]
        assert b["decode_steps"] == 4  # output 5: one token from the prefill
        assert b["prefill_steps"] == -(-b["batch_size"] * 24 // 64)
        assert b["prefill_s"] > 0 and b["step_s"] > 0
        assert b["decode_tok_s"] == pytest.approx(b["batch_size"] / b["step_s"])
        split = b["split_step"]
        parts = (split["host_build_s"] + split["dispatch_s"] + split["device_s"]
                 + split["host_post_s"])
        assert parts == pytest.approx(split["step_s"], rel=0.2)  # medians of the parts
        assert 0 < b["host_fraction"] < 1
        assert b["roofline_s"] == max(b["compute_s"], b["memory_s"])
        assert b["step_bytes"]["weights"] > 0 and b["step_bytes"]["kv_read"] > 0
        assert b["matmul_s"] > 0 and b["step_flops"]["total"] > 0
    # Later batches attend longer contexts only through more requests: KV read grows with B.
    kv = [b["step_bytes"]["kv_read"] for b in result["batches"]]
    assert kv == sorted(kv) and kv[0] < kv[-1]


def test_profile_step_sorts_the_step_into_its_kinds(checkpoint, compilation_cache_dir):
    result = profile_step.main(["--model-path", str(checkpoint("tiny-llama")),
                                "--compilation-cache-dir", compilation_cache_dir,
                                "--batch-size", "4", "--input-len", "24", "--steps", "2",
                                "--max-prefill-tokens", "64"])
    for phase in ("decode", "prefill"):
        kinds = result[phase]["kinds_s"]
        assert set(kinds) == set(profile_step.KINDS)
        # Every step has projections, the attention kernel and the scan's weight slices.
        for kind in ("matmul", "attention", "layer weights sliced"):
            assert kinds[kind] > 0, (phase, kind, kinds)
    assert result["machine"]["cpu_isa"]


def test_plot_one_batch_writes_a_png(one_batch_json, tmp_path):
    _, out = one_batch_json
    png = plot_one_batch.main([str(out), "--out", str(tmp_path / "plot.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeating_prompt_is_the_cycle_the_output_ends_in():
    out = [5, 6, 7] + [1, 2, 3, 4] * 5
    assert bench_speculative.repeating_prompt(out, 10) == [3, 4] + [1, 2, 3, 4] * 2
    assert bench_speculative.repeating_prompt(out, 2) == [1, 2, 3, 4]  # a whole cycle at least
    assert bench_speculative.repeating_prompt(list(range(30)), 8) == list(range(22, 30))


def test_bench_speculative_ngram_on_the_tiny_model(checkpoint, compilation_cache_dir, tmp_path):
    result = bench_speculative.main([
        "--model-path", str(checkpoint("tiny-llama")), "--algorithms", "none", "NGRAM",
        "NGRAM-tree", "--batch-sizes", "2", "--workloads", "repeat", "--output-len", "12",
        "--prompt-len", "16", "--max-prefill-tokens", "32",  # one prefill bucket: 2 x 16
        "--compilation-cache-dir", compilation_cache_dir,
        "--json-out", str(tmp_path / "spec.json")])
    runs = {r["algorithm"]: r for r in result["runs"]}
    assert runs["none"]["accept_length"] is None and runs["none"]["speedup"] == 1.0
    ngram = runs["NGRAM"]
    assert ngram["output_tokens"] == 24 and ngram["same_tokens_as_plain"]
    assert 1.0 <= ngram["accept_length"] <= 4 + 1  # --num-steps 4: at most 5 per round
    tree = runs["NGRAM-tree"]  # tries of 2 continuations, 8 nodes, 4 levels
    assert tree["output_tokens"] == 24 and tree["same_tokens_as_plain"]
    assert 1.0 <= tree["accept_length"] <= 4 + 1
    assert json.loads((tmp_path / "spec.json").read_text())["runs"][1]["algorithm"] == "NGRAM"


def test_bench_moe_layer_and_balance():
    """The layer rows (tiny shapes, one token count) and the balancedness study: a rebalance
    with redundant slots evens a Zipf-skewed load, measured on a fresh sample."""
    args = bench_moe.parse_args(["--tokens", "16", "--reps", "1", "--hidden", "32",
                                 "--moe-intermediate", "16", "--skip-e2e"])
    shapes = bench_moe.layer_shapes(args)
    assert shapes == {"hidden": 32, "moe_intermediate": 16, "num_experts": 8, "top_k": 2}
    (row,) = bench_moe.bench_layer(args, shapes)
    assert row["tokens"] == 16 and row["useful_gflop"] == 2 * 16 * 2 * 3 * 32 * 16 / 1e9
    assert all(row[k] > 0 for k in ("blocked_ms", "ragged_dot_ms", "dense_reference_ms",
                                    "flop_floor_ms"))
    rows = bench_moe.bench_balance(args)
    assert [(r["ep_size"], r["redundant"]) for r in rows] == [(4, 0), (4, 4), (8, 0), (8, 8)]
    for r in rows:
        assert 0 < r["balancedness_before"] < r["balancedness_after"] <= 1, r
        assert r["max_over_mean_after"] < r["max_over_mean_before"], r
