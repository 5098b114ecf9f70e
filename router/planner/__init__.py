"""Throughput model and optimizer of the PrfaaS-PD deployment (paper §2-3). numpy only."""

from .curves import Curve, ProfileError
from .model import Hardware, Stages, System, Ttft, stages, ttft_no_queue
from .optimize import PlanRow, best_split, best_threshold, plan_homogeneous, plan_naive, plan_prfaas, surface
from .scenario import Scenario, load_scenario, parse_scenario

__all__ = [
    "Curve", "ProfileError", "Hardware", "Stages",
    "System", "Ttft", "stages", "ttft_no_queue", "PlanRow", "best_split", "best_threshold",
    "plan_homogeneous", "plan_naive", "plan_prfaas", "surface", "Scenario", "load_scenario", "parse_scenario",
]
