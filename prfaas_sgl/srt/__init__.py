"""The SGLang boundary: the only package of prfaas-sgl that imports sglang or hooks its attributes
(tests/fast/test_structure_boundary.py checks it). Named after `sglang.srt`, the runtime it plugs into.

- `compat`: the plugin's install (version gate, hooks); `flags`: the `--prfaas-*` flags on ServerArgs;
- `backend/`: the `prfaas_zmq` transfer backend (SGLang's KV manager/sender/receiver over `prfaas_sgl.transfer`);
- `cachepool_backend/`: the `prfaas_hybrid` radix cache backend over `prfaas_sgl.cachepool`;
- `cpu/`: the CPU stand-in for `sgl_kernel` (SGLang op signatures over `prfaas_sgl.kernels`) and CPU fixes.

Imports nothing itself: the boot hook and fast tests load single modules from here without SGLang.
"""
