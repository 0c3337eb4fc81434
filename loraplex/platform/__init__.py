"""loraplex platform."""
