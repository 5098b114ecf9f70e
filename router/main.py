"""``python -m prfaas_sgl.launch_router``: parse flags, run the router under uvloop until interrupted."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from .actuators.supervisor import SupervisorActuator
from .app import start_router
from .config import RouterConfig, parse_config
from .controller_glue import close_loop


async def serve(cfg: RouterConfig) -> None:
    handle = await start_router(cfg)
    if cfg.actuator == "supervisor":  # the servers belong to `prfaas up`'s supervisors: act through them
        acting = close_loop(handle.router, lambda cluster, report: SupervisorActuator.from_config(cluster, cfg, report),
                            cfg.switch_params)
        logging.getLogger(__name__).info("controller acts through %s (confirm %d, dwell %.0f s)",
                                         acting.actuator.name, cfg.switch_params.confirm, cfg.switch_params.dwell_s)
    admin = "bearer token" if cfg.admin_token else "open (loopback listener)" if cfg.admin_open else "disabled"
    logging.getLogger(__name__).info("router listening on %s (policy=%s, t=%d, /admin: %s, max body %d B)",
                                     handle.url, cfg.policy, cfg.policy_params.threshold, admin, cfg.body_limit)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await handle.close()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        raise SystemExit(f"prfaas-router: {e}") from e
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(cfg))
