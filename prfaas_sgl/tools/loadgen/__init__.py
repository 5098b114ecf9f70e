"""Load generator for OpenAI-compatible endpoints (the prfaas router or plain SGLang servers).

A small library — no torch, no sglang: sessions built from the shared workload models
(``workload``, over ``prfaas_sgl.workload``'s lengths, arrivals and traces),
prompt text (``prompts``), the streaming client (``client``), the run loop (``runner``), statistics and
reports (``stats``, ``prom``, ``report``, ``plots``) and the ``prfaas bench`` CLI (``cli``).
"""
