"""loraplex storage/kv."""
