"""The HTTP serving layer: OpenAI-compatible and SGLang-native endpoints over one `Engine`.

`app.build_app(engine, ...)` returns the ASGI app; `jaxrunner.cli` runs it with uvicorn. The engine
is driven by one thread (`engine_loop.EngineLoop`); tokenization, chat templates and incremental
detokenization happen on the asyncio side, so the engine never waits for a client.
"""
