"""Builds the long-term controller named by ``--controller`` (router/controller.py, planner helper).

Kept apart so the router runs, unchanged, whether or not the planner's controller is installed.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .config import RouterConfig

log = logging.getLogger(__name__)


def build_controller(cfg: RouterConfig) -> Any:
    """Return a controller with ``observe(l, now)`` / ``maybe_update(now)``, or None.

    The planner's throughput model comes from ``--controller-scenario``; the current split is what this
    router was started with (local prefill instances, decode instances) and t starts at ``--threshold``.
    """
    if cfg.controller == "none":
        return None
    try:
        ctl = importlib.import_module("prfaas_sgl.router.controller")
        scenario = importlib.import_module("prfaas_sgl.router.planner.scenario")
    except ImportError as e:
        log.error("--controller planner: router/controller.py is not importable (%s); running without", e)
        return None
    system = scenario.load_scenario(cfg.controller_scenario).system
    ccfg = ctl.ControllerConfig(interval_s=cfg.controller_interval_s)
    return ctl.LongTermController(ccfg, system, (len(cfg.local_prefill), len(cfg.decode)), cfg.threshold)
