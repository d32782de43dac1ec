"""The C kernels (*.c, kernels.h), how they are built and cached (build.py), and their Python wrappers (ops.py)."""
