"""Triton kernels (``@triton.jit`` only); launchers live in :mod:`fmha.launch`."""
