"""Actuators of the long-timescale controller: see base.py."""
