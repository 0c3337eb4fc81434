"""The OpenAI surface: request bodies, their parameters, the request pipeline, responses and SSE.

| module | owns |
|---|---|
| ``protocol`` | the request bodies, and the OpenAI fields refused as unsupported |
| ``json_body`` | reading a body: strict UTF-8 / JSON, no lone surrogates, then the pydantic model |
| ``params`` | request body -> ``SamplingParams`` under the server's limits |
| ``submission`` | the engine side of a request: submit its prompts, collect, abort |
| ``completion`` | ``complete``: a completions body run to its response (the route's and the playground's) |
| ``serving`` | the client side: admit through the gate, run while the client is connected, answer |
| ``beam_search`` | ``use_beam_search``: one-token requests per beam, ranked by the offline search's rule |
| ``streaming`` | SSE chunks, error events, and a response that watches the client |
| ``responses`` / ``logprobs`` | response bodies and OpenAI's two logprobs shapes |
| ``tools`` | ``tools`` / ``tool_choice`` checked, forced choices turned into a grammar, calls read back |
| ``tool_parsers`` | tool calls read out of a model's text, one parser per family (hermes, mistral, ...) |
| ``tool_stream`` | a tool-calling answer streamed as OpenAI's ``delta.tool_calls`` chunks |
"""
