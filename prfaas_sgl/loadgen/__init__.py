"""Load generator for OpenAI-compatible endpoints (the prfaas router or plain SGLang servers).

A small library — no torch, no sglang: workloads (``workload``, ``lengths``, ``arrivals``, ``trace``),
prompt text (``prompts``), the streaming client (``client``), the run loop (``runner``), statistics and
reports (``stats``, ``prom``, ``report``, ``plots``) and the ``prfaas bench`` CLI (``cli``).
"""
