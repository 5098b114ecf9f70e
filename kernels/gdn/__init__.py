"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): naive reference and CPU serving kernels."""
