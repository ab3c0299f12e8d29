"""The C++ CPU kernel (kernels_cpu) against the jnp reference and a float64 oracle.

Same random ragged batches as the Pallas kernels (unused pages, page tails and padded sequences
are NaN), plus shapes that exercise the kernel's own seams: head dims that are not a multiple of
its vectors, query blocks split into several work items, contexts spanning many 64-key
tiles, and decode rows read in place versus prefill rows through a transposed tile. The kernel's vector
width and register blocks follow the instruction set it is built for, so the cases also run on
every x86-64 level this CPU can execute (128-bit SSE, the code path NEON takes; AVX2; AVX-512).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_pallas import ragged_paged_attention_reference
from tests.support.ragged_cases import Case, make_inputs, naive_attention, tolerance

CASES = [
    Case(seqs=((1, 5), (1, 40), (1, 17), (1, 64))),  # decode only, MHA
    Case(seqs=((1, 130), (1, 200), (1, 1)), group=4, head_dim=64),  # decode over several tiles
    Case(seqs=((12, 12), (5, 5), (20, 20)), group=4, head_dim=64),  # prefill only
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), num_kv_heads=1, group=8),  # mixed, MQA
    Case(seqs=((3, 70), (1, 130), (9, 9)), group=4, page_size=64),  # prefix + big pages
    Case(seqs=((150, 150), (40, 300)), group=4, head_dim=64),  # several items per sequence
    Case(seqs=((1, 40), (10, 30), (6, 6), (1, 150)), group=4, sliding_window=8),
    Case(seqs=((70, 140), (1, 100)), group=2, head_dim=64, sliding_window=65),
    Case(seqs=((1, 20), (8, 25)), head_dim=64, soft_cap=5.0, q_scale=6.0),
    Case(seqs=((1, 45), (13, 29), (2, 2)), group=4, dtype="bfloat16"),
    Case(seqs=((5, 90), (1, 70)), group=8, num_kv_heads=1, head_dim=64, page_size=64,
         dtype="bfloat16", sliding_window=20, soft_cap=10.0, q_scale=4.0),
    Case(seqs=((1, 21), (4, 9)), group=3, padded_seqs=2),  # a group that is not a power of 2
    Case(seqs=((1, 33), (9, 80)), group=5, head_dim=80, page_size=1),  # 5 vectors; page of 1
    Case(seqs=((1, 50), (17, 66)), group=2, head_dim=40, page_size=4),  # not a multiple of 16
    Case(seqs=((2, 90), (1, 65)), group=16, num_kv_heads=1, head_dim=32),  # 16 rows per token
    # 8-bit caches (NaN-poisoned like the rest): decode rows read in place, prefill through the
    # transposed tile, a head_dim that is not a multiple of 16.
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), num_kv_heads=1, group=8,
         kv_dtype="float8_e4m3fn"),
    Case(seqs=((1, 40), (10, 30), (6, 6)), group=4, head_dim=64, sliding_window=8,
         kv_dtype="float8_e5m2"),
    Case(seqs=((1, 50), (17, 66)), group=2, head_dim=40, page_size=4, kv_dtype="float8_e4m3fn"),
    # head_dim 256 (Gemma 2 / 3): decode and prefill rows, MQA with a window and a soft cap, and
    # bfloat16 over several 64-key tiles.
    Case(seqs=((1, 37), (6, 22), (1, 1), (20, 20)), group=2, head_dim=256),
    Case(seqs=((5, 90), (1, 70)), group=4, num_kv_heads=1, head_dim=256, sliding_window=20,
         soft_cap=30.0, q_scale=8.0),
    Case(seqs=((1, 150), (33, 130)), group=2, head_dim=256, dtype="bfloat16", sliding_window=48),
]


def _run(inputs, march=None):
    fn = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention_cpu(*a, **inputs.kwargs,
                                                                    march=march))
    return fn(*inputs.args)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_kernel_matches_reference(case):
    inputs = make_inputs(case, seed=len(str(case)))
    out = np.asarray(_run(inputs).astype(np.float32))
    n = inputs.num_real_tokens
    assert np.isfinite(out).all(), "NaN/inf in the output (padded rows included)"
    assert (out[n:] == 0).all(), "padded query tokens must give zeros"
    expected = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(out[:n], np.asarray(expected[:n].astype(np.float32)),
                               atol=tol, rtol=tol)


# Decode in place, prefill through tiles over several items, bf16, a 5-vector head, a head dim
# that is no multiple of any vector width, 16 rows per token, an 8-bit cache.
LEVEL_CASES = [CASES[1], CASES[5], CASES[10], CASES[12], CASES[13], CASES[14], CASES[16]]


# The highest level this CPU runs has the native build's vector width: the tests above cover it.
@pytest.mark.parametrize("march", kernels_cpu.runnable_levels()[:-1] or
                         [pytest.param(None, marks=pytest.mark.skip("no lower x86-64 level"))])
def test_cpu_kernel_every_instruction_set_level(march):
    for case in LEVEL_CASES:
        inputs = make_inputs(case, seed=len(str(case)) + 1)
        n = inputs.num_real_tokens
        out = np.asarray(_run(inputs, march).astype(np.float32))
        assert np.isfinite(out).all() and (out[n:] == 0).all(), (march, case)
        expected = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
        tol = tolerance(case.dtype)
        np.testing.assert_allclose(out[:n], np.asarray(expected[:n].astype(np.float32)),
                                   atol=tol, rtol=tol, err_msg=f"{march} {case}")


def test_cpu_kernel_rejects_an_unknown_level():
    with pytest.raises(ValueError, match="march must be one of"):
        kernels_cpu.load("pentium4")


@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[12], CASES[15]], ids=str)
def test_cpu_kernel_matches_float64_oracle(case):
    inputs = make_inputs(case, seed=7)
    out = np.asarray(_run(inputs))[:inputs.num_real_tokens]
    np.testing.assert_allclose(out, naive_attention(case, inputs), atol=2e-5, rtol=2e-5)


def test_cpu_kernel_random_batches():
    """Random mixes of decode, prefill and extend-with-prefix, one batch per seed."""
    rng = np.random.default_rng(0)
    for seed in range(12):
        seqs = []
        for _ in range(rng.integers(1, 7)):
            kv_len = int(rng.integers(1, 300))
            q_len = 1 if rng.random() < 0.5 else int(rng.integers(1, kv_len + 1))
            seqs.append((q_len, kv_len))
        case = Case(seqs=tuple(seqs), num_kv_heads=int(rng.choice([1, 2])),
                    group=int(rng.choice([1, 2, 4, 7])), head_dim=int(rng.choice([32, 64, 96])),
                    page_size=int(rng.choice([1, 8, 16, 32])),
                    sliding_window=None if rng.random() < 0.7 else int(rng.integers(1, 100)),
                    padded_seqs=int(rng.integers(0, 3)), padded_tokens=int(rng.integers(0, 5)))
        inputs = make_inputs(case, seed=seed)
        out = np.asarray(_run(inputs))
        expected = np.asarray(ragged_paged_attention_reference(*inputs.args, **inputs.kwargs))
        n = inputs.num_real_tokens
        np.testing.assert_allclose(out[:n], expected[:n], atol=1e-5, rtol=1e-5, err_msg=str(case))


def test_cpu_kernel_deterministic_across_threads():
    """Work items land on different threads from call to call; results must not change."""
    inputs = make_inputs(CASES[5], seed=3)
    first = np.asarray(_run(inputs))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(_run(inputs)), first)


def test_cpu_kernel_rejects_other_dtypes():
    inputs = make_inputs(CASES[0])
    q, kv, *rest = inputs.args
    with pytest.raises(ValueError, match="f32 or bf16"):
        jax.block_until_ready(kernels_cpu.ragged_paged_attention_cpu(
            q.astype(jnp.float16), kv.astype(jnp.float16), *rest, **inputs.kwargs))


def test_auto_backend_falls_back_to_native_without_compiler(monkeypatch, caplog):
    from jaxrunner.attention import resolve_backend_name
    assert resolve_backend_name("auto", "cpu") == "cpu"
    monkeypatch.setattr(kernels_cpu, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level("WARNING"):
        assert resolve_backend_name("auto", "cpu") == "native"
    assert "no C++ compiler found" in caplog.text
    assert resolve_backend_name("auto", "tpu") == "pallas"


def test_build_error_names_the_problem(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels_cpu, "_SOURCE", tmp_path / "broken.cc")
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    with pytest.raises(kernels_cpu.KernelBuildError, match="broken.cc"):
        kernels_cpu._build()
