"""Kubernetes actuator: moves the local PD split by patching the prefill and decode StatefulSets' `scale`.

The StatefulSets are those `prfaas render k8s` writes (`prefill`, `decode` in the local namespace); the router
lists every ordinal, so a pod the patch adds joins the pool once its health probe passes, and the pod a patch
removes (the highest ordinal) is dropped when its probes fail. Each apply re-reads both scales (someone may
have scaled by hand), shrinks before it grows (the freed node's GPUs are what the new pod waits for), and
sends the read resourceVersion with each patch, so a concurrent writer makes the patch fail with 409 instead
of being overwritten. Every API error or timeout comes back as ``Action(outcome="failed")``: the controller
never sees an exception from here. The `kubernetes` client is synchronous; calls run in a worker thread with
a per-request timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from .base import Action, Split

MERGE_PATCH = "application/merge-patch+json"
ROLES = ("prefill", "decode")


class K8sActuator:
    name = "k8s"

    def __init__(self, apps_api: Any, namespace: str, initial: Split, *, prefill: str = "prefill",
                 decode: str = "decode", timeout_s: float = 10.0) -> None:
        """``apps_api``: a ``kubernetes.client.AppsV1Api``; ``initial``: the replicas last seen."""
        self.api, self.namespace, self.timeout_s = apps_api, namespace, timeout_s
        self.names = {"prefill": prefill, "decode": decode}
        self._observed = initial

    @classmethod
    def in_cluster(cls, namespace: str | None = None, **kw: Any) -> "K8sActuator":
        """From the pod's service account (the router's, bound by `prfaas render k8s` to get/patch the two
        scales); the namespace defaults to PRFAAS_K8S_NAMESPACE. Reads the current replicas (raises if it
        cannot: a start-up error, not a controller one)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)  # this client only, not the process default
        cfg.retries = 0  # the controller's next tick is the retry; urllib3's would stretch each timeout
        api = client.AppsV1Api(client.ApiClient(cfg))
        ns = namespace or os.environ["PRFAAS_K8S_NAMESPACE"]
        probe = cls(api, ns, Split(1, 1), **kw)
        probe._observed = Split(*(probe._read_sync(r)[0] for r in ROLES))
        return probe

    def current(self) -> Split:
        return self._observed

    async def apply(self, target: Split, reason: str) -> Action:
        before = self._observed
        try:
            seen = {role: await asyncio.to_thread(self._read_sync, role) for role in ROLES}
        except Exception as e:  # noqa: BLE001 - any API failure is an outcome, not a crash
            return self._action(before, before, reason, "failed", f"read scale: {_why(e)}")
        try:
            now = Split(seen["prefill"][0], seen["decode"][0])
        except ValueError as e:  # someone scaled a role to 0: leave it to them
            return self._action(before, before, reason, "refused", str(e))
        self._observed = now
        if now == target:
            return self._action(now, now, reason, "refused", "replicas already at target")
        want = {"prefill": target.prefill, "decode": target.decode}
        order = sorted(ROLES, key=lambda r: want[r] - seen[r][0])  # shrink first
        done: list[str] = []
        for role in order:
            replicas, version = seen[role]
            if want[role] == replicas:
                continue
            try:
                await asyncio.to_thread(self._patch_sync, role, want[role], version)
            except Exception as e:  # noqa: BLE001
                detail = f"patch {self.names[role]} scale: {_why(e)}" + (f" (after {', '.join(done)})" if done else "")
                return self._action(now, self._observed, reason, "failed", detail)
            self._observed = Split(**{**_as_dict(self._observed), role: want[role]})
            done.append(f"{self.names[role]} {replicas}->{want[role]}")
        return self._action(now, self._observed, reason, "applied", ", ".join(done))

    def _read_sync(self, role: str) -> tuple[int, str]:
        scale = self.api.read_namespaced_stateful_set_scale(self.names[role], self.namespace,
                                                            _request_timeout=self.timeout_s)
        return int(scale.spec.replicas or 0), scale.metadata.resource_version

    def _patch_sync(self, role: str, replicas: int, version: str) -> None:
        body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": replicas}}
        self.api.patch_namespaced_stateful_set_scale(self.names[role], self.namespace, body,
                                                     _content_type=MERGE_PATCH, _request_timeout=self.timeout_s)

    def _action(self, before: Split, after: Split, reason: str, outcome: str, detail: str) -> Action:
        return Action(self.name, before, after, reason, outcome, detail)


def _as_dict(split: Split) -> dict[str, int]:
    return {"prefill": split.prefill, "decode": split.decode}


def _why(e: Exception) -> str:
    """One line for the log and the Action: the API's status and message, or the transport error."""
    status = getattr(e, "status", None)
    if status is not None:
        message = getattr(e, "reason", "") or ""
        try:
            message = json.loads(getattr(e, "body", "") or "{}").get("message") or message
        except (ValueError, AttributeError):
            pass
        return f"HTTP {status}: {message}"
    return f"{type(e).__name__}: {e}"
