"""Step 2 of the ladder: the materialising baseline (S and P written to global memory)."""
