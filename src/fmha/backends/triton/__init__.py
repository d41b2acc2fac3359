"""The portable Triton kernels: forward, backward, their launchers and tile configs (any GPU, and the CPU
through Triton's interpreter)."""
