"""tiny-gpt-oss's tokenizer as GPT-OSS's: the harmony tokens at the end of the vocabulary, the
stop tokens in generation_config (what the engine stops at), a harmony chat template; the trained
tokens before them are the other presets' (whose tokenizer is unchanged)."""

from transformers import AutoTokenizer

from models.config import ModelConfig
from models.testing import harmony


def test_harmony_tokens_stops_and_template(checkpoint):
    path = checkpoint("tiny-gpt-oss")
    tok = AutoTokenizer.from_pretrained(path)
    llama = AutoTokenizer.from_pretrained(checkpoint("tiny-llama"))
    vocab_size = ModelConfig.from_pretrained(path).vocab_size
    ids = harmony.token_ids(vocab_size)
    assert len(tok) == vocab_size and ids["<|call|>"] == vocab_size - 1
    assert {t: tok.convert_tokens_to_ids(t) for t in harmony.HARMONY_TOKENS} == ids
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (harmony.BOS, harmony.EOS,
                                                             harmony.PAD)
    assert ModelConfig.from_pretrained(path).eos_token_ids == tuple(
        ids[t] for t in harmony.STOP_TOKENS)
    shared = {t: i for t, i in llama.get_vocab().items() if i < vocab_size - 9}
    assert {t: i for t, i in tok.get_vocab().items() if i < vocab_size - 9} == shared
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True, reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>") and "\nReasoning: low\n" in text
    assert text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    encoded = tok.encode(text, add_special_tokens=False)   # each marker one token
    assert encoded.count(ids["<|start|>"]) == 3 and encoded.count(ids["<|end|>"]) == 2
