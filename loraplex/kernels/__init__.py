"""loraplex kernels."""
