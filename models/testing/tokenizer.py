"""The random checkpoints' tokenizer: a small byte-level BPE trained on a deterministic built-in
corpus (docstrings of the Python standard library's top-level modules, in module-name order: no
downloads; it may differ between Python versions, never between runs of one), with Qwen2's
pre-tokenizer, special tokens and a ChatML template."""

import ast
from collections.abc import Iterator
import functools
import json
from pathlib import Path
import sysconfig
from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from models.testing import harmony

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
# Qwen2's (and, up to digit grouping, Llama 3's) pre-tokenizer split: words, single digits,
# punctuation runs, newlines, spaces.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def stdlib_docstring_corpus() -> list[str]:
    """Docstrings (module, classes, functions) of the stdlib's top-level modules, by module name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts.extend(_docstrings(tree))
    if not texts:
        raise RuntimeError(f"no docstrings found under {root} to train the tokenizer on")
    return texts


def _docstrings(tree: ast.Module) -> Iterator[str]:
    nodes = [tree] + [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    for node in list(nodes):
        if isinstance(node, ast.ClassDef):
            nodes.extend(n for n in node.body if isinstance(n, ast.FunctionDef))
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc:
            yield doc


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Exactly the pipeline transformers 5's Qwen2Tokenizer rebuilds around vocab + merges (it
    # ignores the file's normalizer and pre-tokenizer), so every loader tokenizes alike.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_docstring_corpus(), trainer)
    # Llama-style: encoding prepends <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int, with_harmony: bool = False) -> Tokenizer:
    """Byte-level BPE with at most vocab_size tokens (fewer if the corpus runs out of merges);
    `with_harmony`: the harmony tokens take the last ids (trained with that many fewer)."""
    trained = vocab_size - len(harmony.HARMONY_TOKENS) if with_harmony else vocab_size
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(trained))
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    if with_harmony:
        harmony.add_tokens(tokenizer, vocab_size)
    return tokenizer


def write_tokenizer(out: Path, tokenizer: Tokenizer, max_length: int,
                    with_harmony: bool = False) -> None:
    """tokenizer.json and its configuration; `with_harmony` (GPT-OSS): the harmony tokens are
    the special ones (BOS, EOS and PAD in GPT-OSS's roles) and the template is harmony's."""
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    extra = [IM_START, IM_END]
    bos, eos, pad, template = BOS, EOS, PAD, CHAT_TEMPLATE
    if with_harmony:
        specials.update({tok: tokenizer.token_to_id(tok) for tok in harmony.HARMONY_TOKENS})
        extra += [t for t in harmony.HARMONY_TOKENS if t not in (harmony.BOS, harmony.EOS,
                                                                 harmony.PAD)]
        bos, eos, pad, template = harmony.BOS, harmony.EOS, harmony.PAD, harmony.CHAT_TEMPLATE
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for tok, i in specials.items()
    }
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "additional_special_tokens": extra,
        "added_tokens_decoder": added,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    })
    write_json(out / "special_tokens_map.json", {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "additional_special_tokens": extra,
    })
