from jaxrunner.batch.forward_mode import CaptureHiddenMode
from jaxrunner.batch.forward_mode import ForwardMode as M


def test_there_are_sglangs_eight_modes():
    assert [m.name for m in M] == ["EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY",
                                   "DRAFT_EXTEND", "SPLIT_PREFILL", "DLLM_EXTEND"]


def test_is_extend_covers_every_ragged_mode():
    assert {m for m in M if m.is_extend()} == {
        M.EXTEND, M.MIXED, M.DRAFT_EXTEND, M.TARGET_VERIFY, M.SPLIT_PREFILL, M.DLLM_EXTEND}


def test_batch_size_bucketed_modes_match_sglangs_cuda_graph_modes():
    expected = {M.DECODE, M.TARGET_VERIFY, M.IDLE, M.DLLM_EXTEND}
    assert {m for m in M if m.is_batch_size_bucketed()} == expected
    assert {m for m in M if m.is_cuda_graph()} == expected


def test_single_mode_predicates():
    checks = {"is_decode": M.DECODE, "is_mixed": M.MIXED, "is_idle": M.IDLE,
              "is_target_verify": M.TARGET_VERIFY, "is_draft_extend": M.DRAFT_EXTEND,
              "is_split_prefill": M.SPLIT_PREFILL, "is_dllm_extend": M.DLLM_EXTEND}
    for predicate, mode in checks.items():
        assert [m for m in M if getattr(m, predicate)()] == [mode], predicate
    assert {m for m in M if m.is_decode_or_idle()} == {M.DECODE, M.IDLE}


def test_capture_hidden_mode():
    assert not CaptureHiddenMode.NULL.need_capture()
    assert CaptureHiddenMode.LAST.need_capture() and CaptureHiddenMode.LAST.is_last()
    assert CaptureHiddenMode.FULL.need_capture() and CaptureHiddenMode.FULL.is_full()
    assert not CaptureHiddenMode.FULL.is_last() and not CaptureHiddenMode.LAST.is_full()
