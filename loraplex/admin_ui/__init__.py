"""loraplex admin_ui."""
