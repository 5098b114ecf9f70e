"""prfaas-sgl: Prefill-as-a-Service on SGLang.

This module is imported by SGLang's plugin loader in *every* SGLang process of the environment, so it
imports nothing heavy: no torch, no sglang, no zmq at import time.
"""

__version__ = "0.1.0"
