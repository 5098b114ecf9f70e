"""K8sActuator against a recorded Kubernetes API exchange (tests/fast/data/k8s/scale_exchanges.json).

A local HTTP server replays the recorded responses in order and keeps what the official `kubernetes` client
sent; each test asserts the exact requests (method, path, content type, body) and the Action the
controller gets. API errors and timeouts must come back as outcome "failed", never as an exception.
"""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from prfaas_sgl.router.actuators.base import Action, Split
from prfaas_sgl.router.actuators.k8s import K8sActuator

EXCHANGES = json.loads((Path(__file__).parent / "data" / "k8s" / "scale_exchanges.json").read_text())


class Replay(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, exchanges: list[dict]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.exchanges, self.seen = list(exchanges), []


class _Handler(BaseHTTPRequestHandler):
    server: Replay

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        req = {"method": self.command, "path": self.path}
        if raw:
            req.update(content_type=self.headers.get("Content-Type"), body=json.loads(raw))
        self.server.seen.append(req)
        if not self.server.exchanges:
            self.send_error(599, "no recorded exchange left")
            return
        resp = self.server.exchanges.pop(0)["response"]
        if resp.get("delay_s"):
            threading.Event().wait(resp["delay_s"])
        body = json.dumps(resp["body"]).encode()
        try:
            self.send_response(resp["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except BrokenPipeError:  # the timeout scenario: the client gave up first
            pass

    do_GET = do_PATCH = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def replay(request):
    """(server, AppsV1Api) for the scenario named by the test's parameter."""
    server = Replay(EXCHANGES[request.param])
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    cfg = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    cfg.retries = 0
    yield server, client.AppsV1Api(client.ApiClient(cfg))
    server.shutdown()
    server.server_close()


def expected(name: str) -> list[dict]:
    return [ex["request"] for ex in EXCHANGES[name]]


def run(act: K8sActuator, target: Split, reason: str = "long_share_up") -> Action:
    return asyncio.run(act.apply(target, reason))


@pytest.mark.parametrize("replay", ["switch_prefill_to_decode"], indirect=True)
def test_switch_shrinks_then_grows_with_merge_patches(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1))
    action = run(act, Split(1, 2))
    assert server.seen == expected("switch_prefill_to_decode")  # GET both, PATCH prefill, then decode
    assert action == Action("k8s", Split(2, 1), Split(1, 2), "long_share_up", "applied",
                            "prefill 2->1, decode 1->2")
    assert act.current() == Split(1, 2)


@pytest.mark.parametrize("replay", ["already_at_target"], indirect=True)
def test_no_patch_when_replicas_already_match(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1))  # stale: someone scaled by hand
    action = run(act, Split(1, 2))
    assert server.seen == expected("already_at_target")
    assert (action.outcome, action.before, action.after) == ("refused", Split(1, 2), Split(1, 2))
    assert act.current() == Split(1, 2)


@pytest.mark.parametrize("replay", ["conflict"], indirect=True)
def test_conflict_is_a_failed_action(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1))
    action = run(act, Split(1, 2))
    assert server.seen == expected("conflict")
    assert (action.outcome, action.after) == ("failed", Split(2, 1))
    assert action.detail.startswith("patch prefill scale: HTTP 409: Operation cannot be fulfilled")
    assert act.current() == Split(2, 1)


@pytest.mark.parametrize("replay", ["forbidden_after_shrink"], indirect=True)
def test_forbidden_grow_reports_the_shrink_that_happened(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1))
    action = run(act, Split(1, 2))
    assert server.seen == expected("forbidden_after_shrink")
    assert (action.outcome, action.before, action.after) == ("failed", Split(2, 1), Split(1, 1))
    assert "HTTP 403" in action.detail and action.detail.endswith("(after prefill 2->1)")
    assert act.current() == Split(1, 1)  # what the cluster now runs


@pytest.mark.parametrize("replay", ["not_found"], indirect=True)
def test_missing_statefulset_is_a_failed_action(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1))
    action = run(act, Split(1, 2))
    assert server.seen == expected("not_found")
    assert action == Action("k8s", Split(2, 1), Split(2, 1), "long_share_up", "failed",
                            'read scale: HTTP 404: statefulsets.apps "prefill" not found')


@pytest.mark.parametrize("replay", ["timeout"], indirect=True)
def test_timeout_is_a_failed_action(replay):
    server, api = replay
    act = K8sActuator(api, "prfaas-local", Split(2, 1), timeout_s=0.3)
    action = run(act, Split(1, 2))
    assert server.seen == expected("timeout")  # one GET: no retry stretches the timeout
    assert (action.outcome, action.after) == ("failed", Split(2, 1))
    assert action.detail.startswith("read scale: ") and "timed out" in action.detail.lower()


@pytest.mark.parametrize("replay", ["already_at_target"], indirect=True)
def test_in_cluster_reads_the_current_replicas(replay, monkeypatch):
    server, _ = replay
    host = f"http://127.0.0.1:{server.server_address[1]}"
    # the service account's token and CA are the kubelet's business; the API address is what matters here
    monkeypatch.setattr("kubernetes.config.load_incluster_config",
                        lambda client_configuration: setattr(client_configuration, "host", host))
    monkeypatch.setenv("PRFAAS_K8S_NAMESPACE", "prfaas-local")
    act = K8sActuator.in_cluster()
    assert server.seen == expected("already_at_target") and act.current() == Split(1, 2)
