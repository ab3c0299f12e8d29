"""compile-check's command line: its flags beside the engine's, the table it prints, its JSON
and its exit status (0: every program compiles and the model fits; 1: not; 2: bad input)."""

import argparse
import json
import sys

from jaxrunner.compile_check.check import CheckResult, engine_args, read_model_config, run_check
from jaxrunner.compile_check.slices import SLICES, BadInput, parse_slice

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2


def add_check_args(parser: argparse.ArgumentParser) -> None:
    """compile-check's own flags (the engine's are added beside them)."""
    parser.add_argument("--target", required=True,
                        help=f"the slice to compile for: {', '.join(SLICES)}")
    parser.add_argument("--json", dest="json_out", default=None,
                        help="also write the result as one JSON object to this file")


def run(flags: dict, target: str, json_out: str | None) -> int:
    """Runs a check from the parsed flags (EngineArgs fields, tp_size None for the whole
    slice); prints the table; returns the exit status. Bad input: one line on stderr, 2."""
    try:
        slice_ = parse_slice(target)
        args = engine_args(flags, slice_)
        result = run_check(args, read_model_config(args.model_path), slice_)
    except BadInput as error:
        print(f"compile-check: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(table(result))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return EXIT_OK if result.fits else EXIT_DOES_NOT_FIT


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def table(result: CheckResult) -> str:
    """Every program (compiled or its error, temporaries, seconds), then the memory per device
    and the answer."""
    gib = 2**30
    lines = [f"{'program':<40} {'ok':<4} {'temp MiB':>9} {'s':>6}  error"]
    for p in result.programs:
        lines.append(f"{p.name:<40} {'yes' if p.ok else 'NO':<4} {p.temp_bytes / 2**20:>9.1f} "
                     f"{p.compile_s:>6.1f}  {p.error}")
    per = result.per_device
    lines += [
        f"{result.target}: {result.devices} devices, TP {result.tp_size}, DP {result.dp_size}, "
        f"EP {result.ep_size}; {result.compiled} programs compiled, {result.failed} failed in "
        f"{result.compile_s:.0f} s",
        f"per device: weights {per.weights_bytes / gib:.2f} GiB + KV cache "
        f"{per.kv_cache_bytes / gib:.2f} GiB + largest temporaries "
        f"{per.max_temp_bytes / gib:.2f} GiB + other {per.other_bytes / gib:.2f} GiB = "
        f"{per.total_bytes / gib:.2f} GiB of {per.hbm_bytes / gib:.2f} GiB",
        *([f"experts: {result.expert_bits_per_weight:.2f} bits per weight"]
          if result.expert_bits_per_weight is not None else []),
        f"KV cache: {result.kv_tokens} tokens; fits: {'yes' if result.fits else 'no'}"]
    if not result.fits:
        lines.append(f"to change: {result.to_json()['advice']}")
    return "\n".join(lines)
