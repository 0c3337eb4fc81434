"""loraplex kernels/torch_ref."""
