"""The cost model of one deployment: KV bytes crossing the link, prefill time and queue wait.

Shared by the routing policies (router/policy.py), the router's link accounting (router/routing.py) and the
simulator. Pure arithmetic. Units: tokens, bytes, seconds.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from prfaas_sgl.cliargs import FieldError, knob


@dataclass(frozen=True, slots=True)
class ModelCost:
    """KV size and prefill-time model of one deployment.

    Prefill time is quadratic in the uncached length l: ``a + b*l + c*l^2`` seconds, one triple per pool
    (the paper's H20 fit is a=0.468, b=1.300e-4, c=2.98e-10).
    """

    kv_bytes_per_token: float = knob(MISSING, "full-attention KV bytes per token (link accounting)")
    state_bytes: float = knob(0.0, "fixed per-request state bytes (linear/SWA states + aux)")
    local_coef: tuple[float, float, float] = knob((0.0, 1e-4, 0.0), "local prefill s = a + b*l + c*l^2")
    remote_coef: tuple[float, float, float] = knob((0.0, 5e-5, 0.0), "remote prefill s = a + b*l + c*l^2")

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise FieldError("kv_bytes_per_token",
                             "kv_bytes_per_token must be > 0 (bytes of full-attention KV per token)")
        if self.state_bytes < 0:
            raise FieldError("state_bytes", "state_bytes must be >= 0")
        for name in ("local_coef", "remote_coef"):
            coef = tuple(float(x) for x in getattr(self, name))  # a TOML/JSON file gives a list
            if len(coef) != 3:
                raise FieldError(name, f"{name} takes three numbers a b c (seconds = a + b*l + c*l^2)")
            object.__setattr__(self, name, coef)

    def kv_bytes(self, tokens: int) -> float:
        """Bytes crossing the link for ``tokens`` of KV plus the fixed state."""
        return self.state_bytes + self.kv_bytes_per_token * max(tokens, 0)

    def prefill_s_local(self, tokens: int) -> float:
        return _quad(self.local_coef, tokens)

    def prefill_s_remote(self, tokens: int) -> float:
        return _quad(self.remote_coef, tokens)

    def wait_s_local(self, inflight: int, queued_tokens: int) -> float:
        """Seconds a new request waits behind a local prefill instance's queue (see ``queue_wait_s``)."""
        return queue_wait_s(self.local_coef, inflight, queued_tokens)

    def wait_s_remote(self, inflight: int, queued_tokens: int) -> float:
        return queue_wait_s(self.remote_coef, inflight, queued_tokens)


def _quad(coef: tuple[float, float, float], tokens: int) -> float:
    if tokens <= 0:
        return 0.0
    a, b, c = coef
    return a + b * tokens + c * tokens * tokens


def queue_wait_s(coef: tuple[float, float, float], inflight: int, queued_tokens: int) -> float:
    """Queue wait on one prefill instance: ``a * inflight + b * queued_tokens`` seconds (a, b of its pool's fit).

    The fixed cost once per queued request plus the linear cost of the uncached tokens ahead; the quadratic
    term is left out because the queue's lengths are not known, only their sum.
    """
    a, b, _ = coef
    return a * inflight + b * queued_tokens
