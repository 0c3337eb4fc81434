"""loraplex platform/model."""
