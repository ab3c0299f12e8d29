"""compile-check: will this model run on that slice, and with how much KV cache?

    python -m jaxrunner.compile_check --model-path DIR --target TARGET [--tp-size N
        --dp-size N --ep-size N] [any other engine flag] [--json OUT]

(also `jaxrunner compile-check ...`). DIR is a checkpoint or just its config.json (weights are
never read: shapes come from the config). TARGET is a slice: `v5e-1`, `v6e-4`, `h100-8`, ...
(slices.py). It builds the engine's mesh over the slice's compile-only devices, plans memory as
the engine would there (`mem_fraction_static` of the chip's HBM, the programs' temporaries as
compiled), compiles every program start-up compiles with the chip's own compiler, prints a
table, and with `--json` writes one object (check.py: `CheckResult.to_json`). Exit status 0 when
every program compiles and the model fits, 1 when not (with advice), 2 for bad input (one line).
Run with `JAX_PLATFORMS=cpu` where libtpu and jax's CUDA plugin are installed.
"""

from jaxrunner.compile_check.check import CheckResult, run_check
from jaxrunner.compile_check.report import add_check_args, run
from jaxrunner.compile_check.slices import SLICES, BadInput, parse_slice

__all__ = ["SLICES", "BadInput", "CheckResult", "add_check_args", "parse_slice", "run",
           "run_check"]
