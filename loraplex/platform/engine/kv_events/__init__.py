"""KV cache events for outside routers, in vLLM's ZeroMQ + msgpack format (``--kv-events-config``).

| module | owns |
|---|---|
| ``config`` | ``KVEventsConfig``: vLLM's fields and defaults, parsed from JSON |
| ``wire`` | the msgpack layout of a batch (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) |
| ``publisher`` | ``ZmqEventPublisher``: PUB and replay sockets on a thread of their own; drops, never waits |
| ``stream`` | ``KVEventStream``: the cache's event log, flushed as one batch per step |

The events themselves are the cache's (``loraplex.storage.kv.kv_events``): emitted where a block
enters or leaves a tier. See docs/deployment.md, "Routing", for what a router does with them.
"""
