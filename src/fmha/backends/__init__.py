"""The kernels and what can run them: each backend says whether it supports a call, and why not."""
