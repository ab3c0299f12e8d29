"""`python -m tests.support.fault_server FAULTS [jaxrunner serve flags]`: the server exactly as
`jaxrunner serve` starts it, with failures injected between its scheduler and its worker
(tests/support/faults.py). FAULTS is a JSON list of {"token": id, "at": "launch" | "readback",
"times": n, "lose_device_state": bool, "record": path}: the first `times` steps that prefill a
prompt starting with token `id` fail; `record` gets the failed steps' rows after each failure."""

import argparse
import json
import sys

from jaxrunner import cli
from jaxrunner.engine.engine import Engine
from tests.support.faults import Fault, prompt_starting_with, install


def main(argv: list[str]) -> None:
    faults = [Fault(prompt_starting_with(spec["token"]), at=spec.get("at", "launch"),
                    times=spec.get("times", 1),
                    lose_device_state=spec.get("lose_device_state", False),
                    record=spec.get("record"))
              for spec in json.loads(argv[0])]

    def faulty_engine(**kwargs) -> Engine:
        engine = Engine(**kwargs)
        install(engine, *faults)
        return engine

    parser = argparse.ArgumentParser(prog="fault_server")
    cli.add_serve_args(parser)
    cli.serve(parser.parse_args(argv[1:]), make_engine=faulty_engine)


if __name__ == "__main__":
    main(sys.argv[1:])
