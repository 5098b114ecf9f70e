"""Causal depthwise conv1d with per-request conv state (Mamba / GDN short convolution)."""
