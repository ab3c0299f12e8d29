"""`python -m jaxrunner.compile_check ...`: the `jaxrunner compile-check` command."""

import sys

from jaxrunner.cli import main

if __name__ == "__main__":
    main(["compile-check", *sys.argv[1:]])
