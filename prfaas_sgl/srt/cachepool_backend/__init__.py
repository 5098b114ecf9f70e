"""`--radix-cache-backend prfaas_hybrid`: SGLang's prefix cache for hybrid linear-attention models (GDN,
KDA, Lightning: any model SGLang keeps Mamba-pool states for), indexed by our
HybridCachePool (prfaas_sgl.cachepool) over SGLang's own KV slots and Mamba state slots.

`register()` runs in every SGLang process (plugin install) and only adds a name to SGLang's registry;
the cache module (and its torch/sglang imports) loads when a server selects the backend.
"""
from __future__ import annotations

NAME = "prfaas_hybrid"


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if NAME not in registered_radix_cache_backends():  # the plugin loader may run twice in one process
        register_radix_cache_backend(NAME, _factory)


def _factory(ctx):
    from .cache import build

    return build(ctx)
