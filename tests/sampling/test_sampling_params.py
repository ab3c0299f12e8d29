import pytest

from jaxrunner.sampling.params import SamplingParams

VOCAB = 100


def test_defaults_verify_and_sample():
    p = SamplingParams()
    p.verify(VOCAB)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.stop is None and p.stop_token_ids is None and not p.ignore_eos
    assert not p.is_greedy


def test_from_dict_builds_params():
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 20, "stop": "\n"})
    assert (p.temperature, p.top_k, p.stop) == (0.5, 20, "\n")


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="frequency_penalties.*tempreature"):
        SamplingParams.from_dict({"tempreature": 0.5, "frequency_penalties": 1.0, "top_k": 3})


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=5e-6), True),  # below SGLang's 1e-5 greedy threshold
        (SamplingParams(temperature=0.7, top_k=1), True),
        (SamplingParams(temperature=0.7), False),
        (SamplingParams(temperature=0.7, top_k=2), False),
    ],
)
def test_is_greedy(params, expected):
    assert params.is_greedy is expected


def test_normalized_makes_lists():
    assert SamplingParams().normalized().stop == []
    assert SamplingParams().normalized().stop_token_ids == []
    assert SamplingParams(stop="END").normalized().stop == ["END"]
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2]).normalized()
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_new_tokens=0),
        dict(temperature=0),
        dict(top_p=1e-9),
        dict(top_k=0),
        dict(top_k=VOCAB * 10),
        dict(min_p=1.0),
        dict(seed=0),
        dict(seed=2**40),
        dict(stop_token_ids=[0, VOCAB - 1]),
        dict(stop=["a"], ignore_eos=True),
        dict(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=2.0),
        dict(logit_bias={"0": -100, VOCAB - 1: 100.0}, min_new_tokens=128),
        dict(json_schema='{"type": "object"}', stop_regex=[r"\d+", "end"]),
    ],
)
def test_verify_accepts_edge_values(fields):
    SamplingParams(**fields).verify(VOCAB)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(temperature="hot"), "temperature='hot'"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=None), "top_p=None"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(top_k=True), "top_k=True"),
        (dict(min_p=-0.01), "min_p=-0.01"),
        (dict(min_p=1.01), "min_p=1.01"),
        (dict(max_new_tokens=-1), "max_new_tokens=-1"),
        (dict(max_new_tokens=3.0), "max_new_tokens=3.0"),
        (dict(seed=1.5), "seed=1.5"),
        (dict(seed="42"), "seed='42'"),
        (dict(stop_token_ids=[5, VOCAB]), "stop_token_ids=.*100"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids=\[-1\]"),
        (dict(stop_token_ids=["7"]), "stop_token_ids="),
        (dict(stop_token_ids=7), "stop_token_ids=7"),
        (dict(stop=3), "stop=3"),
        (dict(stop=["ok", 3]), "stop="),
        (dict(ignore_eos="yes"), "ignore_eos='yes'"),
        (dict(frequency_penalty=2.5), "frequency_penalty=2.5"),
        (dict(presence_penalty=-3), "presence_penalty=-3"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(min_new_tokens=-1), "min_new_tokens=-1"),
        (dict(min_new_tokens=200), "min_new_tokens=200 must not exceed max_new_tokens=128"),
        (dict(logit_bias={"x": 1.0}), "logit_bias="),
        (dict(logit_bias={VOCAB: 1.0}), r"logit_bias=.*\[0, 100\)"),
        (dict(logit_bias={"5": 101}), "logit_bias=.*-100, 100"),
        (dict(logit_bias={str(i): 1 for i in range(301)}), "more than 300"),
        (dict(json_schema="{}", regex="a"), "regex=.*cannot be combined with json_schema"),
        (dict(ebnf=""), "ebnf='' must be a non-empty string"),
        (dict(stop_regex="(a"), "stop_regex=.*not a valid regular expression"),
        (dict(stop_regex=["a*"]), "stop_regex='a\\*' matches the empty string"),
        (dict(n=0), "n=0"),
    ],
)
def test_verify_rejects_naming_field_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields).verify(VOCAB)
