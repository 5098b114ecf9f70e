"""Names the router shares with its clients (load generator, chaos campaign, dashboards): defined once here.

Both sides import these; a rename on one side can no longer leave the other reading a name nobody writes.
Nothing else lives here (no imports), so the load generator can read it without the router's dependencies.
"""

ROUTE_HEADER = "x-prfaas-route"  # response header: "prfaas" | "local", where the prefill ran
REMOTE_ROUTE = "prfaas"

METRIC_PREFIX = "prfaas_router_"
DECISIONS = METRIC_PREFIX + "decisions_total"  # counter {route, reason}
LINK_UTILIZATION = METRIC_PREFIX + "link_utilization"  # gauge
LINK_GOODPUT_BPS = METRIC_PREFIX + "link_goodput_bps"  # gauge
LINK_BYTES_TOTAL = METRIC_PREFIX + "link_bytes_total"  # counter
LINK_CAPACITY_BPS = METRIC_PREFIX + "link_capacity_bps"  # gauge
