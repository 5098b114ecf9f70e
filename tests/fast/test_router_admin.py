"""The control surface of the router: ``/admin/*`` on its open loopback listener refuses what a browser page or
a proxy would send for someone else (router/admin.py), and PD room ids are unpredictable (router/forward.py).

The default router (127.0.0.1, no token) answered a text/plain POST, which any web page open on the same host
can send without a CORS preflight, and ignored Host and Origin (DNS rebinding, same-host proxies). Room ids came
from ``random.Random``: two routers started with the same seed handed out the same rooms, and a Mersenne Twister
is predictable from 624 outputs; a predicted room can be aborted or failed by anyone who reaches a server.
"""

from __future__ import annotations

import pytest

from .test_router_http import LONG, SHORT, rig, run

pytestmark = pytest.mark.timeout(60)


def test_a_browser_simple_post_cannot_change_routing(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            url = r.router.url + "/admin/routing"
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                async with r.http.post(url, data=b'{"policy": "all_remote"}', headers={"Content-Type": ctype}) as resp:
                    out = await resp.json()
                    assert resp.status == 415 and out["error"]["code"] == "unsupported_media_type", out
            assert r.router.router.core.policy_name == "threshold"
            async with r.http.post(url, json={"policy": "all_remote"}) as resp:  # what curl -H/json= sends
                assert resp.status == 200 and (await resp.json())["policy"] == "all_remote"
    run(body())


@pytest.mark.parametrize("headers,why", [
    ({"Host": "attacker.example:8000"}, "Host"),  # DNS rebinding: the page's own domain resolves to 127.0.0.1
    ({"Host": "10.0.0.5"}, "Host"),  # a same-host reverse proxy relaying the public name
    ({"Origin": "http://attacker.example"}, "Origin"),
    ({"Origin": "null"}, "Origin"),  # a sandboxed frame or a file:// page
])
def test_foreign_host_or_origin_is_refused_on_the_open_listener(tmp_path, headers, why):
    async def body():
        async with rig(tmp_path) as r:
            url = r.router.url + "/admin/routing"
            async with r.http.post(url, json={"threshold": 0}, headers=headers) as resp:
                out = await resp.json()
                assert resp.status == 403 and out["error"]["code"] == "admin_forbidden" and why in out["error"]["message"]
            async with r.http.get(url, headers=headers) as resp:
                assert resp.status == 403
            assert r.router.router.core.policy.threshold == 32
            same = {"Origin": r.router.url}  # a same-origin Origin is this listener's own
            for ok in ({}, same, {"Host": "localhost"}, {"Host": "[::1]:80"}):
                async with r.http.get(url, headers=ok) as resp:
                    assert resp.status == 200, ok
            generate = {"model": "tiny", "prompt": SHORT}  # generation endpoints are not admin: served
            async with r.http.post(r.router.url + "/v1/completions", json=generate, headers=headers) as resp:
                assert resp.status == 200
    run(body())


def test_with_a_token_host_and_origin_do_not_matter_but_json_does(tmp_path):
    async def body():
        async with rig(tmp_path, admin_token="s3cret") as r:
            url, auth = r.router.url + "/admin/routing", {"Authorization": "Bearer s3cret"}
            async with r.http.post(url, json={"threshold": 7}, headers={**auth, "Host": "router.example"}) as resp:
                assert resp.status == 200
            async with r.http.post(url, data=b'{"threshold": 8}', headers={**auth, "Content-Type": "text/plain"}) as resp:
                assert resp.status == 415
            assert r.router.router.core.policy.threshold == 7
    run(body())


def test_routers_started_alike_hand_out_different_rooms(tmp_path):
    """Both rigs start their router with ``seed=0``: the old rooms were the same sequence in both."""
    async def rooms(sub: str) -> list[int]:
        async with rig(tmp_path / sub) as r:
            for _ in range(4):
                assert (await r.post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 1}))[0] == 200
            return [b["bootstrap_room"] for b in r.decode.received]

    async def body():
        first, second = await rooms("a"), await rooms("b")
        assert all(0 <= room < 2**63 for room in first + second)
        assert len(set(first + second)) == 8
    run(body())
