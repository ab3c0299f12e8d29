"""SGLang's lifecycle routes over HTTP on the suite's server (started without CPU backup):
weights read back and updated from base64 safetensors, memory released (requests answered 503)
and resumed, weights refilled from disk, the prefix cache flushed, and prompts given as
embeddings in /generate. Every test leaves the server's weights as the checkpoint has them."""

import base64

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save as save_safetensors

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 130))]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _post(server, path, body=None, status=200):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, (path, r.status_code, r.text)
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def _generate(server, status=200, **body):
    return _post(server, "/generate", {"sampling_params": GREEDY, **body}, status)


def _ids(outs):
    return [o["output_ids"] for o in outs]


def _blob(tensors: dict) -> str:
    return base64.b64encode(save_safetensors(tensors)).decode()


@pytest.fixture(scope="module")
def hf_tensors(model_path):
    return load_file(str(model_path / "model.safetensors"))


def test_get_weights_by_name_gives_the_checkpoints_rows(server, hf_tensors):
    name = "model.layers.1.mlp.up_proj.weight"
    got = _post(server, "/get_weights_by_name", {"name": name, "truncate_size": 3})
    np.testing.assert_array_equal(np.array(got, np.float32), hf_tensors[name][:3])
    error = _post(server, "/get_weights_by_name", {"name": "model.layers.99.mlp.x"}, 400)
    assert "model.layers.99.mlp.x" in error["error"]["message"]


def test_update_from_tensor_changes_the_outputs_and_updating_back_restores_them(
        server, hf_tensors):
    before = _ids(_generate(server, input_ids=PROMPTS))
    name = "lm_head.weight"
    rng = np.random.default_rng(0)
    other = rng.standard_normal(hf_tensors[name].shape).astype(np.float32) * 0.05
    answer = _post(server, "/update_weights_from_tensor",
                   {"serialized_named_tensors": [_blob({name: other})],
                    "weight_version": "step-1"})
    assert answer == {"success": True, "message": "updated 1 tensor(s)",
                      "weight_version": "step-1"}
    outs = _generate(server, input_ids=PROMPTS)
    assert _ids(outs) != before
    assert {o["meta_info"]["weight_version"] for o in outs} == {"step-1"}
    assert server.info()["weight_version"] == "step-1"
    np.testing.assert_array_equal(
        np.array(_post(server, "/get_weights_by_name", {"name": name, "truncate_size": 2}),
                 np.float32), other[:2])
    # A wrong shape fails, says why, and changes nothing (the version neither).
    bad = _post(server, "/update_weights_from_tensor",
                {"serialized_named_tensors": _blob({name: other[:, :7]})}, 400)
    assert not bad["success"] and "shape" in bad["message"] and bad["weight_version"] == "step-1"
    assert _ids(_generate(server, input_ids=PROMPTS)) == _ids(outs)
    assert _post(server, "/update_weights_from_tensor",
                 {"serialized_named_tensors": _blob({name: hf_tensors[name]}),
                  "weight_version": "default"})["success"]
    assert _ids(_generate(server, input_ids=PROMPTS)) == before


def test_bad_serialized_tensors_get_a_clear_error(server):
    for blob, words in [("not base64!", "not base64"),
                        (base64.b64encode(b"garbage").decode(), "not a safetensors file")]:
        error = _post(server, "/update_weights_from_tensor",
                      {"serialized_named_tensors": blob}, 400)
        assert words in error["error"]["message"]


def test_release_refuses_requests_and_resume_then_update_from_disk_serves_again(
        server, model_path):
    before = _ids(_generate(server, input_ids=PROMPTS))
    assert _post(server, "/release_memory_occupation", {})["success"]
    try:
        refused = _generate(server, 503, input_ids=PROMPTS)
        assert "released" in refused["error"]["message"]
        bad = _post(server, "/resume_memory_occupation", {"tags": ["kv"]}, 400)
        assert "unknown memory tag" in bad["error"]["message"]
        assert _post(server, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})[
            "success"]
        # No CPU backup: the weights are zeros, so requests wait for new weights.
        assert "weights" in _generate(server, 503, input_ids=PROMPTS)["error"]["message"]
    finally:
        answer = _post(server, "/update_weights_from_disk", {"model_path": str(model_path)})
    assert answer["success"] and answer["weight_version"] == "default"
    outs = _generate(server, input_ids=PROMPTS)
    assert _ids(outs) == before
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 2


def test_update_from_disk_that_does_not_fit_fails_and_changes_nothing(server, tmp_path):
    answer = _post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}, 400)
    assert not answer["success"] and str(tmp_path) in answer["message"]


def test_flush_cache_empties_the_prefix_cache(server):
    _generate(server, input_ids=list(range(200, 264)))
    assert server.info()["kv_pages_cached"] > 0
    assert _post(server, "/flush_cache").startswith("Cache flushed")
    assert server.info()["kv_pages_cached"] == 0


def test_input_embeds_of_the_prompts_embeddings_give_the_same_tokens(server, hf_tensors):
    table = hf_tensors["model.embed_tokens.weight"]
    want = _ids(_generate(server, input_ids=PROMPTS))
    one = _generate(server, input_embeds=table[PROMPTS[0]].tolist())
    batch = _generate(server, input_embeds=[table[p].tolist() for p in PROMPTS])
    assert one["output_ids"] == want[0] and _ids(batch) == want
    assert one["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    error = _generate(server, 400, input_embeds=[[0.0] * 7] * 3)
    assert "hidden_size" in error["error"]["message"]
    error = _generate(server, 400, input_ids=PROMPTS[0], input_embeds=table[PROMPTS[0]].tolist())
    assert "exactly one" in error["error"]["message"]
