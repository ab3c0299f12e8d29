"""`python -m jaxrunner.compile_check`: its answer for a model that fits and one that does not,
its JSON, its exit status, and one-line errors for bad input."""

import json
import sys
from pathlib import Path

import pytest

from jaxrunner.cli import main
from kernels_pallas.targets import TPU_V5E, TPU_V7X
from models.testing.random_checkpoint import hf_config
from tests.lowering.compile_cache import skip_without_compiler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from model_configs import GPT_OSS_120B, LLAMA3_70B  # noqa: E402 (after the path above)

# Few buckets: the check compiles every program start-up would.
SMALL = ["--max-running-requests", "2", "--max-prefill-tokens", "32", "--context-length", "256",
         "--dtype", "bfloat16"]


def _model_dir(tmp_path, config: dict) -> str:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _check(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile-check", *argv])
    return exit_info.value.code


def test_a_small_model_fits_and_the_json_says_so(tmp_path, capsys):
    skip_without_compiler(TPU_V5E)
    model = _model_dir(tmp_path, dict(hf_config("tiny-llama", "bfloat16"), head_dim=128))
    out = tmp_path / "check.json"
    assert _check(["--model-path", model, "--target", "v5e-1", *SMALL, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["target"] == "v5e-1" and result["devices"] == 1 and result["fits"]
    assert result["failed"] == 0 and result["compiled"] == len(result["programs"]) > 3
    assert {"name", "ok", "error", "temp_bytes", "compile_s"} <= set(result["programs"][0])
    per = result["per_device"]
    assert per["hbm_bytes"] == TPU_V5E.hbm_bytes()
    assert per["total_bytes"] == (per["weights_bytes"] + per["kv_cache_bytes"]
                                  + per["max_temp_bytes"] + per["other_bytes"]) <= per["hbm_bytes"]
    assert result["kv_tokens"] >= 256
    assert "fits: yes" in capsys.readouterr().out


def test_a_model_too_large_for_the_slice_gets_advice_not_a_crash(tmp_path, capsys):
    """Llama-3-70B in bfloat16 (141 GB) on one v5e (16 GB): compiled with a one-request KV
    cache all the same; fits false, exit 1, and what to change."""
    skip_without_compiler(TPU_V5E)
    model = _model_dir(tmp_path, LLAMA3_70B)
    out = tmp_path / "check.json"
    assert _check(["--model-path", model, "--target", "v5e-1", *SMALL, "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert not result["fits"] and result["kv_tokens"] == 0
    assert result["per_device"]["weights_bytes"] > result["per_device"]["hbm_bytes"]
    assert "more chips" in result["advice"] and "--quantization" in result["advice"]
    assert "fits: no" in capsys.readouterr().out


def test_gpt_oss_120b_experts_take_4_25_bits_per_weight(tmp_path, capsys):
    """gpt-oss-120b as published (MXFP4 experts) on one v7x chip (TP 2 over its two cores): the
    check reports its experts held 4-bit with their block scales, 4.25 bits per weight, and
    the weights in a third of each core's HBM."""
    skip_without_compiler(TPU_V7X)
    model = _model_dir(tmp_path, GPT_OSS_120B)
    out = tmp_path / "check.json"
    _check(["--model-path", model, "--target", "v7x-1", *SMALL, "--json", str(out)])
    result = json.loads(out.read_text())
    assert abs(result["expert_bits_per_weight"] - 4.25) < 0.05 * 4.25
    per = result["per_device"]
    assert per["weights_bytes"] < per["hbm_bytes"] / 3
    assert "experts: 4.25 bits per weight" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--target", "v9e-4"], "unknown target 'v9e-4'"),
    (["--target", "v6e-4", "--tp-size", "3"], "tp_size x dp_size = 3 x 1 does not divide the 4"),
    (["--target", "h100-8", "--dp-size", "3"], "dp_size 3 does not divide the 8"),
    (["--target", "v6e-1", "--architecture-is-not-a-flag"], None),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    model = _model_dir(tmp_path, hf_config("tiny-llama", "bfloat16"))
    assert _check(["--model-path", model, *argv]) == 2
    err = capsys.readouterr().err.strip()
    if message is not None:
        assert err.splitlines() == [f"compile-check: error: {err.split('error: ', 1)[1]}"]
        assert message in err


def test_a_config_the_engine_cannot_serve_is_one_line_and_exit_2(tmp_path, capsys):
    model = _model_dir(tmp_path, dict(hf_config("tiny-llama"), architectures=["GPT2LMHeadModel"]))
    assert _check(["--model-path", model, "--target", "v6e-1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("compile-check: error:") and "GPT2LMHeadModel" in line
