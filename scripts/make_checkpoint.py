"""Write a random-initialised Hugging Face checkpoint (config, weights, tokenizer) for a preset.

    python scripts/make_checkpoint.py --preset small --out /tmp/small \
        [--dtype float32|bfloat16] [--seed 0] [--shards 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from models.testing.random_checkpoint import PRESETS, make_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--shards", default=1, type=int, help="number of safetensors shards")
    args = parser.parse_args(argv)
    out = make_checkpoint(
        args.out, args.preset, seed=args.seed, dtype=args.dtype, shards=args.shards
    )
    print(out)


if __name__ == "__main__":
    main()
