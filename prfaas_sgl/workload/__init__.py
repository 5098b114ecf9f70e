"""Workload models shared by the load generator, the simulator and the planner: token lengths
(``lengths``), arrival processes (``arrivals``) and Mooncake-style traces (``traces``).

numpy only: no torch, no sglang, nothing from the router, so every side imports the same definitions.
"""
