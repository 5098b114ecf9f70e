"""Kimi Delta Attention (Kimi Linear's linear attention): naive reference and CPU serving kernels."""
