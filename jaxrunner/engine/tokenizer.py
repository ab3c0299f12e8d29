"""Loading a checkpoint's tokenizer through transformers, which the engine needs for nothing else.

Without torch installed (the engine does not need it), importing transformers logs an advisory
that models will not be available; for a tokenizer that is noise a user cannot act on, so this
module drops exactly that record.
"""

import logging

_TORCH_ADVISORY = "PyTorch was not found"


class _DropTorchAdvisory(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _TORCH_ADVISORY not in record.getMessage()


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)`, without transformers' torch advisory."""
    # transformers logs through the "transformers" logger; a filter set before its import stays.
    logging.getLogger("transformers").addFilter(_DropTorchAdvisory())
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
