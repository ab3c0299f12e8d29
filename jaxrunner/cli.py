"""The `jaxrunner` command. `jaxrunner serve --model-path DIR [--host --port ...]` starts the
HTTP server; its engine flags are generated from the `EngineArgs` fields (names with dashes, help
from the comments above each field), so a new engine option is a CLI flag with no edit here.
`jaxrunner compile-check --model-path DIR --target v6e-4 [engine flags] [--json OUT]` answers
whether the model runs on that slice, and with how much KV cache (jaxrunner/compile_check)."""

import argparse
import asyncio
from collections.abc import Callable
import dataclasses
import inspect
import logging
import re
import sys
import types
import typing

import uvicorn

from jaxrunner import compile_check
from jaxrunner.config import EngineArgs
from jaxrunner.engine.base import ServingEngine
from jaxrunner.engine.engine import Engine
from jaxrunner.engine.lockstep import LockstepEngine
from jaxrunner.server import harmony, reasoning, tool_calls
from jaxrunner.server.app import MAX_PAYLOAD_SIZE, build_app

SERVER_DEFAULTS = dict(host="127.0.0.1", port=30000)


def _field_docs(cls) -> dict[str, str]:
    """The `# ...` comment lines right above each field in the class source."""
    docs, pending = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match and pending:
            docs[match.group(1)] = " ".join(pending)
        pending = []
    return docs


def _base_type(annotation):
    """`int | None` -> (int, True); `str` -> (str, False)."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        non_none = [a for a in args if a is not type(None)]
        return non_none[0], len(non_none) < len(args)
    return annotation, False


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field."""
    docs = _field_docs(EngineArgs)
    group = parser.add_argument_group("engine (EngineArgs)")
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        kind, optional = _base_type(field.type)
        required = (field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING)
        help_text = docs.get(field.name, "")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=help_text)
            continue
        kwargs = dict(type=kind, help=help_text + (" (default: %(default)s)" if not required
                                                   else ""))
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default
        group.add_argument(flag, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> dict:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=SERVER_DEFAULTS["host"],
                        help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=SERVER_DEFAULTS["port"])
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model path)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before "
                             "they are aborted (their streams then end with finish_reason "
                             "\"abort\")")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file, or a built-in name (chatml), for "
                             "checkpoints whose tokenizer has none or to replace it")
    parser.add_argument("--max-payload-size", type=int, default=MAX_PAYLOAD_SIZE,
                        help="the largest request body in bytes; larger ones get 413")
    parser.add_argument("--tool-call-parser", default=None,
                        choices=tool_calls.PARSERS + (harmony.NAME,),
                        help="how tool calls are read from the output (tool_choice='auto'); "
                             "default: inferred from the chat template or the architecture "
                             "(gpt-oss: the harmony format's commentary channel)")
    parser.add_argument("--reasoning-parser", default=None,
                        choices=reasoning.PARSERS + (harmony.NAME,),
                        help="split <think> reasoning into reasoning_content (gpt-oss: the "
                             "harmony format's channels, the default for GPT-OSS checkpoints)")
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="refuse (400) request fields neither OpenAI's nor SGLang's API "
                             "defines; default: accept them and log a warning once per field")
    add_engine_args(parser)


def serve(ns: argparse.Namespace, make_engine: Callable[..., Engine] = Engine) -> None:
    """Loads the engine (`make_engine(**engine args)`, compiling every bucket), then serves
    until SIGINT/SIGTERM, or until the engine loop dies: then the process exits with status 1
    once the requests in flight have their answers (`_GracefulServer`)."""

    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine: ServingEngine = make_engine(**engine_args_from(ns))
    if ns.nnodes > 1:
        # Multi-host: every rank steps the engine in lock-step; rank 0 alone serves HTTP.
        lockstep = LockstepEngine(engine)
        if not lockstep.is_leader:
            logging.getLogger(__name__).info("rank %d follows rank 0", ns.node_rank)
            lockstep.follow()  # raises EngineDeadError (exit status 1) if the ranks diverge
            return
        engine = lockstep
    app = build_app(engine, ns.served_model_name, api_key=ns.api_key,
                    chat_template=ns.chat_template, max_payload_size=ns.max_payload_size,
                    tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                    strict_request_fields=ns.strict_request_fields)
    # Uvicorn's own deadline comes later than ours, so aborted streams can send their last chunk.
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            timeout_graceful_shutdown=ns.shutdown_timeout + 10, access_log=False)
    engine_loop = app.state.server.engine_loop
    _GracefulServer(config, engine_loop, ns.shutdown_timeout).run()
    engine.shutdown()
    if engine_loop.error is not None:
        raise SystemExit(f"the engine loop died; the server stopped: {engine_loop.error}")


class _GracefulServer(uvicorn.Server):
    """On SIGINT/SIGTERM uvicorn stops accepting and waits for in-flight responses; after
    `grace` seconds we abort what the engine still runs, so every stream ends with a final
    chunk (finish_reason "abort") and `[DONE]` rather than a cut connection.

    When the engine loop dies, the requests it held have their errors and /health answers 503;
    `DEAD_LINGER_S` later (so a health check sees the 503 before the port closes) the server
    shuts down the same way, and `serve` exits non-zero."""

    DEAD_LINGER_S = 1.0

    def __init__(self, config, engine_loop, grace: float):
        super().__init__(config)
        self.engine_loop, self.grace = engine_loop, grace
        self._dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_loop.error is not None and not self.should_exit:
            now = asyncio.get_running_loop().time()
            self._dead_since = self._dead_since or now
            if now - self._dead_since >= self.DEAD_LINGER_S:
                logging.getLogger(__name__).error("the engine loop died: shutting down")
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self.grace, self.engine_loop.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        # Uvicorn re-raises the signal after a graceful shutdown (the process would then die by
        # SIGTERM); ours is complete, so the process exits normally with status 0.
        self._captured_signals = []


def add_compile_check_args(parser: argparse.ArgumentParser) -> None:
    compile_check.add_check_args(parser)
    add_engine_args(parser)
    # Left out, the mesh takes every device of the slice.
    parser.set_defaults(tp_size=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jaxrunner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="start the HTTP server"))
    add_compile_check_args(sub.add_parser(
        "compile-check", help="will a model run on a TPU or GPU slice, and with how much KV?"))
    ns = parser.parse_args(argv)
    if ns.command == "compile-check":
        sys.exit(compile_check.run(engine_args_from(ns), ns.target, ns.json_out))
    if ns.command == "serve":
        try:
            EngineArgs(**engine_args_from(ns))
        except (TypeError, ValueError) as e:
            parser.error(str(e))
        serve(ns)


if __name__ == "__main__":
    main()
