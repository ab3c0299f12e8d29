"""Embedding and reward models (jaxrunner/pooling/) against the libraries that define them:
sentence-transformers on random embedding checkpoints of both pooling kinds (the last token,
Qwen3-Embedding's; the mean, with prompts longer than a prefill chunk, so the mean is summed
over chunks), transformers' *ForSequenceClassification on a random reward model; one engine per
model, few buckets, nothing compiled after warm-up."""

import base64

import numpy as np
import pytest
import torch

from jaxrunner.engine.engine import Engine

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Return the value of the attribute",
           "Hello", "Create a new list from the items of an iterable, in order, and then sort "
           "them by key; a very long sentence keeps going so that its tokens fill more than "
           "one prefill chunk of thirty-two tokens, and then some more words after that."]
ENGINE = dict(dtype="float32", page_size=16, max_total_tokens=4096, max_running_requests=4,
              max_prefill_tokens=64, chunked_prefill_size=32, show_progress=False,
              disallow_compile_after_warmup=True)


@pytest.fixture(scope="module")
def engines(checkpoint, compilation_cache_dir):
    made = {}

    def get(preset):
        if preset not in made:
            made[preset] = Engine(model_path=str(checkpoint(preset)),
                                  compilation_cache_dir=compilation_cache_dir, **ENGINE)
        return made[preset]

    yield get
    for engine in made.values():
        engine.shutdown()


def _assert_close(ours, reference):
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    cosine = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1)
                                           * np.linalg.norm(reference, axis=-1))
    assert cosine.min() >= 0.99999, cosine


@pytest.mark.parametrize("preset", ["tiny-qwen3-embedding", "tiny-llama-mean-embedding"])
def test_embeddings_match_sentence_transformers(engines, checkpoint, preset):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    engine = engines(preset)
    assert not engine.model_config.is_generation
    warm = engine.compile_monitor.count
    outs = engine.encode(PROMPTS)
    assert engine.compile_monitor.count == warm  # nothing compiled after warm-up
    assert len(engine.tokenizer.encode(PROMPTS[3])) > ENGINE["chunked_prefill_size"]
    model = sentence_transformers.SentenceTransformer(str(checkpoint(preset)), device="cpu")
    want = model.encode(PROMPTS, convert_to_numpy=True, batch_size=1)
    _assert_close([o["embedding"] for o in outs], want)
    one = engine.encode(PROMPTS[0])
    _assert_close(one["embedding"], want[0])
    assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPTS[0]))
    ids = [engine.tokenizer.encode(PROMPTS[1])]
    if not engine.model_config.is_matryoshka:
        # `dimensions` truncates only a model trained for it (SGLang's rule): refused, named.
        with pytest.raises(ValueError, match="dimensions needs a Matryoshka model"):
            engine.encode(input_ids=ids, dimensions=32)
        return
    # Matryoshka: the first 32 entries, normalised again.
    short = engine.encode(input_ids=ids, dimensions=32)[0]
    head = want[1][:32] / np.linalg.norm(want[1][:32])
    _assert_close(short["embedding"], head)


def test_reward_scores_match_transformers(engines, checkpoint):
    from transformers import AutoModelForSequenceClassification
    engine = engines("tiny-qwen2-reward")
    outs = engine.encode(PROMPTS)
    model = AutoModelForSequenceClassification.from_pretrained(str(checkpoint(
        "tiny-qwen2-reward")), torch_dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([engine.tokenizer.encode(text)])
            want.append(model(input_ids=ids).logits[0].numpy())
    _assert_close([o["embedding"] for o in outs], want)
    assert len(outs[0]["embedding"]) == 1


def test_pooling_models_refuse_generation_and_options(engines):
    engine = engines("tiny-qwen2-reward")
    with pytest.raises(ValueError, match="generates nothing; use encode"):
        engine.generate("hi", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="dimensions applies to embedding models only"):
        engine.encode("hi", dimensions=2)
    embedder = engines("tiny-qwen3-embedding")
    with pytest.raises(ValueError, match=r"dimensions=9999 must be an int in \[1, 256\]"):
        embedder.encode("hi", dimensions=9999)
    mean = engines("tiny-llama-mean-embedding")  # not a Matryoshka model: SGLang's rule
    with pytest.raises(ValueError, match="dimensions needs a Matryoshka model"):
        mean.encode("hi", dimensions=8)


def test_embeddings_and_classify_routes(engines):
    """/v1/embeddings (strings, one string, token ids, lists of them; dimensions; base64),
    /encode, and the reward model's /classify and /v1/classify, in-process."""
    from starlette.testclient import TestClient

    from jaxrunner.server.app import build_app
    engine = engines("tiny-qwen3-embedding")
    want = [o["embedding"] for o in engine.encode(PROMPTS[:2])]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    with TestClient(build_app(engine, "emb")) as client:
        for given in (PROMPTS[:2], ids):
            r = client.post("/v1/embeddings", json={"model": "emb", "input": given})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [d["index"] for d in body["data"]] == [0, 1]
            _assert_close([d["embedding"] for d in body["data"]], want)
            assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
        for given in (PROMPTS[0], ids[0]):
            data = client.post("/v1/embeddings", json={"input": given}).json()["data"]
            _assert_close(data[0]["embedding"], want[0])
        short = client.post("/v1/embeddings", json={"input": PROMPTS[0], "dimensions": 8,
                                                    "encoding_format": "base64"}).json()
        vector = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]),
                               "<f4")
        head = np.asarray(want[0][:8]) / np.linalg.norm(want[0][:8])
        np.testing.assert_allclose(vector, head, atol=1e-5)
        native = client.post("/encode", json={"text": PROMPTS[1]}).json()
        _assert_close(native["embedding"], want[1])
        refused = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400 and "/v1/embeddings" in refused.text
        info = client.get("/get_model_info").json()
        assert info["is_generation"] is False
    reward = engines("tiny-qwen2-reward")
    score = reward.encode(PROMPTS[0])["embedding"]
    with TestClient(build_app(reward, "rm")) as client:
        native = client.post("/classify", json={"text": [PROMPTS[0]]}).json()
        _assert_close(native[0]["embedding"], score)
        labels = client.post("/v1/classify", json={"input": PROMPTS[0]}).json()
        assert labels["data"] == [{"index": 0, "label": "LABEL_0", "probs": [1.0],
                                   "num_classes": 1}]
        wrong = client.post("/v1/embeddings", json={"input": "x"})
        assert wrong.status_code == 400 and "embedding head" in wrong.text
