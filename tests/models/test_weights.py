"""Streaming safetensors checkpoints: single file, sharded, bf16, and every error case."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.loading.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    checkpoint_tensor_names,
    iter_safetensors,
)


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(8).astype(np.float32),
        "model.layers.1.mlp.up_proj.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "model.norm.weight": np.ones(8, np.float32),
    }


def _write_sharded(path, tensors, num_shards):
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, path / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _assert_same(got, want):
    assert sorted(n for n, _ in got) == sorted(want)
    for name, array in got:
        assert array.dtype == want[name].dtype
        np.testing.assert_array_equal(array, want[name])


def test_single_file_round_trip(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / SINGLE_FILE)
    got = list(iter_safetensors(tmp_path))
    _assert_same(got, tensors)
    assert checkpoint_tensor_names(tmp_path) == [n for n, _ in got]


def test_sharded_round_trip(tmp_path):
    tensors = _tensors()
    _write_sharded(tmp_path, tensors, num_shards=3)
    got = list(iter_safetensors(tmp_path))
    _assert_same(got, tensors)
    assert checkpoint_tensor_names(tmp_path) == [n for n, _ in got]


def test_bfloat16(tmp_path):
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors().items()}
    save_file(tensors, tmp_path / SINGLE_FILE)
    _assert_same(list(iter_safetensors(tmp_path)), tensors)


def test_index_preferred_over_single_file(tmp_path):
    tensors = _tensors()
    _write_sharded(tmp_path, tensors, num_shards=2)
    save_file({"stale": np.zeros(1, np.float32)}, tmp_path / SINGLE_FILE)
    assert sorted(checkpoint_tensor_names(tmp_path)) == sorted(tensors)


def test_no_safetensors_lists_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        list(iter_safetensors(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_tensor_names(tmp_path / "nope")


@pytest.mark.parametrize("bin_name", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_bin_only_checkpoint(tmp_path, bin_name):
    (tmp_path / bin_name).write_bytes(b"\0")
    with pytest.raises(ValueError, match="only safetensors"):
        list(iter_safetensors(tmp_path))


def test_missing_shard_named(tmp_path):
    _write_sharded(tmp_path, _tensors(), num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        next(iter_safetensors(tmp_path))  # fails before yielding anything


def test_index_names_tensor_absent_from_shard(tmp_path):
    _write_sharded(tmp_path, _tensors(), num_shards=2)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lm_head.weight"):
        checkpoint_tensor_names(tmp_path)


def test_invalid_index(tmp_path):
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=INDEX_FILE):
        list(iter_safetensors(tmp_path))


def _corrupt_cases(data):
    return {
        "truncated-data": data[:-5],
        "truncated-header": data[:20],
        "garbage": b"this is not a safetensors file" * 4,
        "empty": b"",
    }


@pytest.mark.parametrize("case", ["truncated-data", "truncated-header", "garbage", "empty"])
def test_corrupt_file_named(tmp_path, case):
    save_file(_tensors(), tmp_path / SINGLE_FILE)
    data = (tmp_path / SINGLE_FILE).read_bytes()
    (tmp_path / SINGLE_FILE).write_bytes(_corrupt_cases(data)[case])
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        list(iter_safetensors(tmp_path))


def test_corrupt_shard_named(tmp_path):
    _write_sharded(tmp_path, _tensors(), num_shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(ValueError, match="corrupt safetensors file .*model-00002-of-00002"):
        list(iter_safetensors(tmp_path))
