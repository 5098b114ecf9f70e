"""`--radix-cache-backend prfaas_hybrid`: SGLang's prefix cache for hybrid linear-attention models (GDN,
KDA, Lightning: any model SGLang keeps Mamba-pool states for) and sliding-window hybrids, indexed by our
HybridCachePool (prfaas_sgl.cachepool) over SGLang's own KV slots, Mamba state slots and window pages.

`register()` runs in every SGLang process (plugin install) and only adds a name to SGLang's registry;
the cache modules (and their torch/sglang imports) load when a server selects the backend, and
`cache.build` picks one class per kind (linear.py, sliding.py, decode_kv.py over base.py).
"""
from __future__ import annotations

NAME = "prfaas_hybrid"
CONFIGURE = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure"
DECODE_CACHE_CHECK = "sglang.srt.mem_cache.kv_cache_builder.validate_decode_radix_cache"


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if NAME not in registered_radix_cache_backends():  # the plugin loader may run twice in one process
        register_radix_cache_backend(NAME, _factory)


def _factory(ctx):
    from .cache import build

    return build(ctx)


def after_configure(result, configurator, *args, **kwargs):
    """AFTER hook on KVCacheConfigurator.configure (`CONFIGURE`): with --prfaas-unified-pool, SGLang's
    KV and Mamba pools become one slab (`unified.py`, loaded only then)."""
    from prfaas_sgl.srt import flags

    if not flags.get_config(configurator.server_args).unified_pool:
        return None
    from .unified import unify

    return unify(result, configurator)


def around_decode_cache_check(original, *, model_config, **kwargs):
    """AROUND hook on SGLang's decode radix-cache check (`DECODE_CACHE_CHECK`). SGLang refuses a decode
    radix cache for models whose SWA layers have their own head geometry (MiMo-V2, Gemma 4: "SWA-compress")
    because its own tree does not handle them yet. prfaas_hybrid's decode kind for a sliding-window model
    (decode_kv.DecodeWindowKvCache) indexes full-attention pages only and never reads an SWA page, so
    that one refusal does not apply to it; every other check still runs."""
    from sglang.srt.runtime_context import get_memory

    if get_memory().radix_cache_backend == NAME and getattr(model_config, "is_hybrid_swa_compress", False):
        model_config = _NotCompressed(model_config)
    return original(model_config=model_config, **kwargs)


class _NotCompressed:
    """A read-only view of SGLang's ModelConfig that answers is_hybrid_swa_compress = False."""

    is_hybrid_swa_compress = False

    def __init__(self, config) -> None:
        self._config = config

    def __getattr__(self, name: str):
        return getattr(self._config, name)
