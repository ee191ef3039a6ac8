"""Triton kernels of gdr_dispatch, one per file, each with its launcher beside it."""
