"""`python -m jaxrunner.serve --model-path DIR ...`: the same as `jaxrunner serve ...`."""

import sys

from jaxrunner.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
