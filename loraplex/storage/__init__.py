"""loraplex storage."""
