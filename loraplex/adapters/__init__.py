"""loraplex adapters."""
