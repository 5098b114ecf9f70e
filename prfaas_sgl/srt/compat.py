"""The plugin's install into SGLang, gated on the one SGLang version it was written against.

`install()` runs in every SGLang process (plugin loader). It registers hooks that are cheap until used:
- the `--prfaas-*` flag group and the frozen `PrfaasConfig` stored on the server-args record (`flags`);
- the request guard (`request_guard`): token ids and values that would crash the scheduler get a 400;
- the `prfaas_zmq` transfer backend (enum member, CLI choice, KV classes), if the transport is present;
- CPU fixes, only when SGLang runs on CPU (`SGLANG_USE_CPU_ENGINE=1`).
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
import sys

from prfaas_sgl.srt import flags

log = logging.getLogger(__name__)

PINNED_SGLANG = "0.5.23"
BACKEND = "prfaas_zmq"


class VersionMismatch(SystemExit):
    """SystemExit so SGLang's plugin loader (which logs and swallows Exceptions) cannot bury it."""


def install() -> None:
    if not _version_ok():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    server_args = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{server_args}.add_cli_args", flags.after_add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{server_args}.from_cli_args", flags.around_from_cli_args, HookType.AROUND)
    from prfaas_sgl.srt import request_guard  # always on: a request must never be able to crash a server

    request_guard.install(HookRegistry, HookType)
    _install_transfer_backend(HookRegistry, HookType)
    _install_cache_backend(HookRegistry, HookType)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from prfaas_sgl.srt.cpu import fixes

        fixes.install(HookRegistry, HookType)


def _version_ok() -> bool:
    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        found = "not installed"
    if found == PINNED_SGLANG:
        return True
    msg = f"prfaas_sgl supports sglang=={PINNED_SGLANG} only; found sglang {found}. Install sglang=={PINNED_SGLANG}."
    if _prfaas_requested(sys.argv):
        raise VersionMismatch(f"error: {msg}")
    log.warning("%s prfaas_sgl stays inactive.", msg)
    return False


def _prfaas_requested(argv: list[str]) -> bool:
    return any(a.startswith("--prfaas-") or a == BACKEND for a in argv)


def _install_cache_backend(HookRegistry, HookType) -> None:
    """`--radix-cache-backend prfaas_hybrid` (prfaas_sgl.srt.cachepool_backend); inert unless selected."""
    try:
        from prfaas_sgl.srt import cachepool_backend
    except ImportError as e:
        log.debug("prfaas_hybrid cache backend unavailable: %s", e)
        return
    cachepool_backend.register()
    HookRegistry.register(cachepool_backend.CONFIGURE, cachepool_backend.after_configure, HookType.AFTER)
    HookRegistry.register(cachepool_backend.DECODE_CACHE_CHECK, cachepool_backend.around_decode_cache_check,
                          HookType.AROUND)
    from prfaas_sgl.srt.cachepool_backend import tier_prefetch  # storage-tier prefetch; inert without a prefetcher

    tier_prefetch.register(HookRegistry, HookType)


# --- transfer backend ----------------------------------------------------------------------------


def _install_transfer_backend(HookRegistry, HookType) -> None:
    try:
        from prfaas_sgl.srt.backend import sglang_backend
    except ImportError as e:  # a partial install: SGLang's own transfer backends still work without ours
        log.debug("prfaas_zmq backend unavailable: %s", e)
        return
    sglang_backend.register(HookRegistry, HookType)
