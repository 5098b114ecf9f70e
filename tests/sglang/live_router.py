"""The router in-process on a private event-loop thread, for tests whose clients are synchronous."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.config import RouterConfig


@contextlib.contextmanager
def running_router(cfg: RouterConfig) -> Iterator[tuple[RouterHandle, asyncio.AbstractEventLoop]]:
    """Start the router (after one health round), yield (handle, loop); close it and stop the loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router-loop", daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(start_router(cfg, seed=0), loop).result(60)
    try:
        yield handle, loop
    finally:
        asyncio.run_coroutine_threadsafe(handle.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
