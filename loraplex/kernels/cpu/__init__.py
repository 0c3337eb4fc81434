"""C kernels for the CPU path, compiled for the host on first use (see ``build.py``)."""
