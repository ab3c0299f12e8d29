"""Session fixtures: random checkpoints and one compilation cache, shared by every test (and by
both pytest-xdist workers, which make each checkpoint once under a file lock)."""

import os
from pathlib import Path

import pytest
import torch

from models.loading import orbax_checkpoint
from models.testing.random_checkpoint import cached_checkpoint
from tests.support.files import made_once
from tests.support.presets import SUITE_ENGINE
from tests.support.quantization import make_fp8_block_checkpoints


def pytest_configure(config):
    # The PyTorch references run tiny models: one thread each. With torch's default (a thread
    # per core) their ops wait on threads the engine's XLA runtime keeps busy, and a 2-core
    # machine ran HF's generate on tiny-llama 60x slower (25 s instead of 0.4 s).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory) -> Path:
    """A directory every worker of this run shares: the run's base temporary directory (under
    pytest-xdist, the parent of the workers' own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def checkpoint_root(shared_tmp) -> Path:
    return shared_tmp / "checkpoints"


@pytest.fixture(scope="session")
def compilation_cache_dir(shared_tmp) -> str:
    """The executable cache every engine of the run reads and writes (entries are written
    beside their name and renamed into place, so workers share it safely)."""
    path = shared_tmp / "jax_cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root):
    """`checkpoint(preset)` -> path of a random HF checkpoint, made once per run."""
    return lambda preset: made_once(checkpoint_root / preset,
                                    lambda path: cached_checkpoint(preset, checkpoint_root))


@pytest.fixture(scope="session")
def engine_kwargs(compilation_cache_dir):
    """SUITE_ENGINE with the run's compilation cache and the compile-after-warm-up guard."""
    return dict(SUITE_ENGINE, compilation_cache_dir=compilation_cache_dir,
                disallow_compile_after_warmup=True)


@pytest.fixture(scope="session")
def orbax_llama(checkpoint, checkpoint_root):
    """tiny-llama converted to an orbax checkpoint directory (load_format "orbax")."""
    def convert(out):
        if not orbax_checkpoint.has_checkpoint(out):
            orbax_checkpoint.convert(checkpoint("tiny-llama"), out)
    return made_once(checkpoint_root / "tiny-llama-orbax", convert)


@pytest.fixture(scope="session")
def fp8_checkpoints(checkpoint, checkpoint_root):
    """(tiny-llama pre-quantized to block fp8 as DeepSeek / Qwen3-FP8 publish it, the same
    weights dequantised as float32)."""
    root = made_once(checkpoint_root / "tiny-llama-fp8-block",
                     lambda path: make_fp8_block_checkpoints(checkpoint("tiny-llama"), path))
    return root / "fp8", root / "dequant"
