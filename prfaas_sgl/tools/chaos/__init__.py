"""Fault campaign: the router and real SGLang PD servers (prfaas_zmq) under a seeded load while a seeded
schedule kills -9 and restarts servers and drops the emulated inter-DC link to zero.

Pure parts (tested in tests/fast/test_chaos_schedule.py): `schedule` (fault events from a seed), `plan`
(requests from a seed), `outcome` (classification and counting). Live parts: `topology` (servers, link,
router), `reference` (greedy outputs: HF or a colocated server), `runner` (load + faults). Entry point: scripts/chaos.py.
"""
