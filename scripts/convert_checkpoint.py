"""Write an orbax checkpoint of the model state from a Hugging Face checkpoint, for
`load_format="orbax"` (models/loading/orbax_checkpoint.py describes the directory).

    python scripts/convert_checkpoint.py --model-path HF_DIR --out OUT_DIR [--dtype auto]
    # then: Engine(model_path=OUT_DIR)  (load_format "auto" finds the orbax checkpoint)

OUT_DIR gets config.json, the tokenizer files and orbax/; OUT_DIR may be HF_DIR itself (the
orbax checkpoint is then added beside the safetensors, and load_format="orbax" picks it).
"""

import argparse
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from models.loading.orbax_checkpoint import convert  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights dtype (auto: the checkpoint's)")
    args = parser.parse_args(argv)
    print(convert(args.model_path, args.out, args.dtype))


if __name__ == "__main__":
    main()
