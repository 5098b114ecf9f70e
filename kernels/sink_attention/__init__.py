"""Causal attention with per-head attention sinks and an optional sliding window (gpt-oss, MiMo-V2-Flash):
naive token-by-token reference and the CPU serving kernel."""
