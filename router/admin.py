"""Who may use ``/admin/*``: a holder of the admin token, or, where none is configured and the router listens on
loopback only, a local client that is not a browser page acting for a foreign site.

A page open in any browser on the router's host can POST to 127.0.0.1: a "simple" cross-origin request (form or
text/plain body, no custom header) needs no CORS preflight, and the router would parse its body as JSON. DNS
rebinding lets a page also read answers, by a domain of its own that resolves to 127.0.0.1. So without a token:
- the ``Host`` header must name a loopback address (a rebinding page sends its own domain, a reverse proxy the
  public name it serves);
- an ``Origin`` header, which browsers add to cross-origin requests, must be this listener's own origin;
and with or without a token a POST must be ``application/json``, which no simple request can be.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from aiohttp import web

from .config import RouterConfig, is_loopback
from .errors import ApiError


def _forbidden(why: str) -> ApiError:
    return ApiError(403, f"/admin/* refused: {why}", "permission_error", "admin_forbidden")


def _token_refusal(cfg: RouterConfig, request: web.Request) -> ApiError | None:
    if not cfg.admin_token:
        return ApiError(403, "/admin/* is disabled on a non-loopback listener without an admin token: start the "
                        "router with --admin-token or PRFAAS_ROUTER_ADMIN_TOKEN", "permission_error", "admin_disabled")
    scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), cfg.admin_token.encode()):
        return None
    return ApiError(401, "/admin/* needs 'Authorization: Bearer <admin token>'", "authentication_error",
                    "invalid_admin_token")


def _local_refusal(request: web.Request) -> ApiError | None:
    """On the open loopback listener: refuse what a browser page or a proxy sends for someone else."""
    host = request.headers.get("Host", "")
    name = urlsplit("//" + host).hostname if host else None
    if not name or not is_loopback(name):
        return _forbidden(f"Host {host!r:.80} is not a loopback address; without --admin-token only local "
                          "clients that name 127.0.0.1, ::1 or localhost may use it")
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"http://{host}":
        return _forbidden(f"cross-origin request from Origin {origin!r:.80} (a browser page of another site)")
    return None


def admin_refusal(cfg: RouterConfig, request: web.Request) -> ApiError | None:
    """None when ``request`` may use /admin/*, else the error to answer."""
    refusal = _local_refusal(request) if cfg.admin_open else _token_refusal(cfg, request)
    if refusal is None and request.method == "POST" and request.content_type != "application/json":
        refusal = ApiError(415, f"/admin/* POST needs 'Content-Type: application/json', got "
                           f"{request.content_type!r:.80}", "invalid_request_error", "unsupported_media_type")
    return refusal
