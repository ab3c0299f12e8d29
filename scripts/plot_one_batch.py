"""Plots a `bench_one_batch.py --json-out` result: decode throughput and step time against batch
size, with the matmul-only and roofline times for reference. Writes a PNG.

    python scripts/plot_one_batch.py one_batch.json [--out one_batch.png]

Needs matplotlib: pip install -e '.[bench]'.
"""

import argparse
import json
from pathlib import Path

try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
except ImportError:  # optional: only this script needs it
    plt = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="bench_one_batch.py's JSON result")
    p.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    return p.parse_args(argv)


def plot(result: dict, out: Path) -> None:
    """Two panels: tokens/s (decode and prefill) and decode step time, against batch size."""
    batches = result["batches"]
    if not batches:
        raise SystemExit("the result has no batches to plot")
    sizes = [b["batch_size"] for b in batches]
    fig, (ax_tput, ax_step) = plt.subplots(1, 2, figsize=(11, 4.2))

    ax_tput.plot(sizes, [b["decode_tok_s"] for b in batches], "o-", label="decode")
    ax_tput.plot(sizes, [b["prefill_tok_s"] for b in batches], "s-", label="prefill")
    ax_tput.plot(sizes, [b["batch_size"] / b["roofline_s"] for b in batches], "k--",
                 label="decode at roofline")
    ax_tput.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s",
                title="throughput")

    ax_step.plot(sizes, [1e3 * b["step_s"] for b in batches], "o-", label="decode step")
    ax_step.plot(sizes, [1e3 * b["matmul_s"] for b in batches], "^-", label="its matmuls alone")
    ax_step.plot(sizes, [1e3 * b["roofline_s"] for b in batches], "k--", label="roofline")
    ax_step.plot(sizes, [1e3 * b["host_s"] for b in batches], "x:", label="host part")
    ax_step.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms",
                title="decode step time")

    for ax in (ax_tput, ax_step):
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    model = Path(result.get("model_path", "")).name
    fig.suptitle(f"{model}: input {result['input_len']}, output {result['output_len']}, "
                 f"{result['dtype']} on {result['machine']['device_kind']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> Path:
    args = parse_args(argv)
    if plt is None:
        raise SystemExit("plot_one_batch.py needs matplotlib: pip install -e '.[bench]'")
    path = Path(args.json)
    out = Path(args.out) if args.out else path.with_suffix(".png")
    plot(json.loads(path.read_text()), out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
