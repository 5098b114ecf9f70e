"""The operator's monitoring: alert rules (`alerts.yml`) and their promtool tests, the Grafana dashboard and its
generator (README.md here).

Installed as `prfaas_sgl.monitoring` with `alerts.yml` as package data (setup.py), so `prfaas render prometheus`
copies the rules from a wheel install as well as from the repository.
"""
from importlib.resources import files
from pathlib import Path


def alert_rules() -> Path:
    """The shipped alert rules (Prometheus rule file, group `prfaas`); a real file in either install."""
    return Path(str(files(__name__) / "alerts.yml"))
