"""Tooling around the runtime: what starts, deploys, loads and demonstrates a PrfaaS system, never what runs
inside it.

``launch`` (SGLang server processes), ``netns`` (the emulated inter-DC link), ``deploy`` (``prfaas up`` and
the Kubernetes renderer), ``commands`` (the ``prfaas`` subcommands), ``demo``, ``chaos`` (fault campaigns),
``loadgen`` (load generator) and ``models`` (tiny offline checkpoints). Runtime code (``prfaas_sgl.srt``,
``transfer``, ``workload``, ``config``, the router, the cache pool, the kernels) never imports this package:
tests/fast/test_structure_boundary.py checks it.
"""
