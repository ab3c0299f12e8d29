"""Shared fixtures: random checkpoints and one compilation cache for the whole session."""

import pytest

from models.loading import orbax_checkpoint
from models.testing.random_checkpoint import cached_checkpoint

# Engine settings the tests share, so that engines of one model reuse compiled executables
# through the persistent compilation cache.
ENGINE_DEFAULTS = dict(dtype="float32", page_size=16, max_total_tokens=32768,
                       max_running_requests=16, max_prefill_tokens=512, show_progress=False)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "checkpoints"


@pytest.fixture(scope="session")
def compilation_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root):
    """`checkpoint(preset)` -> path of a random HF checkpoint, made once per session."""
    return lambda preset: cached_checkpoint(preset, checkpoint_root)


@pytest.fixture(scope="session")
def engine_kwargs(compilation_cache_dir):
    return dict(ENGINE_DEFAULTS, compilation_cache_dir=compilation_cache_dir,
                disallow_compile_after_warmup=True)


@pytest.fixture(scope="session")
def orbax_llama(checkpoint, checkpoint_root):
    """tiny-llama converted to an orbax checkpoint directory (load_format "orbax")."""
    out = checkpoint_root / "tiny-llama-orbax"
    if not orbax_checkpoint.has_checkpoint(out):
        orbax_checkpoint.convert(checkpoint("tiny-llama"), out)
    return out
