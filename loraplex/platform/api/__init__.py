"""The HTTP layer: the OpenAI-compatible FastAPI app over ``AsyncEngine``.

It imports the engine, never the reverse. The multi-tenant gateway (API keys,
quotas, the admin UI) grows here.

| module | owns |
|---|---|
| ``app`` | ``build_app``: the app, its state, error handlers, middleware and routes |
| ``server`` | ``Server`` / ``serve``: uvicorn until a signal or the engine dies (exit code 1) |
| ``routes/`` | ``completions``, ``chat``, ``models`` (with ``/health``): one module per resource |
| ``deps`` | ``ServerState`` and the ``StateDep`` dependency the routes share |
| ``limits`` | ``ServerLimits``: per-request limits, each a ``loraplex serve`` flag |
| ``body`` | reading a body: the size limit, strict UTF-8 / JSON, no lone surrogates |
| ``protocol`` | the request bodies, and the OpenAI fields refused as unsupported |
| ``params`` | request body -> ``SamplingParams`` under the limits |
| ``submission`` | the engine side of a request: submit its prompts, collect, abort |
| ``serving`` | the client side: run while the client is connected, answer whole or streamed |
| ``streaming`` | SSE chunks, error events, and a response that watches the client |
| ``responses`` / ``logprobs`` | response bodies and OpenAI's two logprobs shapes |
| ``errors`` | OpenAI's error body for every error, and which exception maps to which status |
"""
