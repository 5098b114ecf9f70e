"""Discrete-event simulator of PrfaaS-PD; routing by the router's own policy objects."""
