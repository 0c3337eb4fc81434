"""loraplex kernels/triton."""
