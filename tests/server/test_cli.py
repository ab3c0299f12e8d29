"""The serve flags come from EngineArgs: every field is a flag, with its default and type."""

import argparse
import dataclasses

import pytest

from jaxrunner.cli import add_serve_args, engine_args_from, main
from jaxrunner.config import EngineArgs


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_every_engine_field_is_a_flag_with_its_default():
    ns = _parse(["--model-path", "m"])
    assert engine_args_from(ns) == dataclasses.asdict(EngineArgs(model_path="m"))
    assert (ns.host, ns.port) == ("127.0.0.1", 30000)


def test_flags_are_typed():
    ns = _parse(["--model-path", "m", "--page-size", "32", "--max-total-tokens", "4096",
                 "--mem-fraction-static", "0.5", "--no-show-progress",
                 "--disallow-compile-after-warmup"])
    args = EngineArgs(**engine_args_from(ns))
    assert (args.page_size, args.max_total_tokens, args.mem_fraction_static) == (32, 4096, 0.5)
    assert args.show_progress is False and args.disallow_compile_after_warmup is True


def test_invalid_engine_args_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model-path", "m", "--page-size", "24"])
    assert e.value.code == 2
    assert "power of two" in capsys.readouterr().err
