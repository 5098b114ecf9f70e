"""How one request ended, and the campaign's counts.

Outcomes (checked in this order):

    HANG     no HTTP answer before the client gave up (bound + grace)
    DROPPED  no HTTP answer: the router closed or refused the connection (the router is never killed)
    LATE     an answer, but after the bound
    OK       HTTP 200, not aborted, output_ids == the greedy reference (HF or colocated, batch 1)
    WRONG    HTTP 200, not aborted, other tokens (or another count) than the reference
    ERROR    a clear error: HTTP >= 400 with a message, or HTTP 200 whose finish_reason is an abort with
             a message (SGLang's in-band abort; counted apart as status "200-abort")
    UNCLEAR  anything else: an error without a message, a 200 without output_ids, a body that is not JSON

The campaign passes when WRONG, HANG, LATE, DROPPED, UNCLEAR and lost (sent minus answered) are all 0.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

OK, ERROR, WRONG, HANG, LATE, DROPPED, UNCLEAR = "ok", "error", "wrong", "hang", "late", "dropped", "unclear"
OUTCOMES = (OK, ERROR, WRONG, HANG, LATE, DROPPED, UNCLEAR)
VIOLATIONS = (WRONG, HANG, LATE, DROPPED, UNCLEAR)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the client saw. status None: no HTTP answer (client_error says why)."""

    status: int | None
    body: object  # parsed JSON, or the raw text when it was not JSON
    elapsed_s: float
    client_error: str = ""
    timed_out: bool = False  # the client's own deadline passed


def error_message(body: object) -> str:
    """The message of an error body in OpenAI ({"error": {"message"}}), SGLang ({"error": str} or
    {"message"}) or in-band abort (meta_info.finish_reason.message) form; '' when there is none."""
    if not isinstance(body, dict):
        return ""
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or "")
    if err:
        return str(err)
    if body.get("message"):
        return str(body["message"])
    finish = finish_reason(body)
    return str(finish.get("message") or "") if finish.get("type") == "abort" else ""


def finish_reason(body: dict) -> dict:
    meta = body.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return finish if isinstance(finish, dict) else {}


def classify(ans: Answer, reference: list[int], bound_s: float) -> tuple[str, str]:
    """(outcome, detail) for one answer; `reference` is the greedy output."""
    if ans.status is None:
        return (HANG if ans.timed_out else DROPPED), ans.client_error
    if ans.elapsed_s > bound_s:
        return LATE, f"HTTP {ans.status} after {ans.elapsed_s:.1f}s > bound {bound_s:.0f}s"
    if ans.status != 200:
        msg = error_message(ans.body)
        return (ERROR if msg else UNCLEAR), f"HTTP {ans.status}: {msg or str(ans.body)[:200]}"
    if not isinstance(ans.body, dict):
        return UNCLEAR, f"HTTP 200, not JSON: {str(ans.body)[:200]}"
    if finish_reason(ans.body).get("type") == "abort" or ans.body.get("error"):
        msg = error_message(ans.body)
        return (ERROR if msg else UNCLEAR), f"HTTP 200 abort: {msg or str(ans.body)[:200]}"
    out = ans.body.get("output_ids")
    if not isinstance(out, list):
        return UNCLEAR, f"HTTP 200 without output_ids: {str(ans.body)[:200]}"
    if out != reference:
        return WRONG, f"got {out}, reference {reference}"
    return OK, ""


@dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    kind: str
    n_tokens: int
    send_s: float  # seconds after the load started
    elapsed_s: float
    outcome: str
    status: int | None
    route: str  # x-prfaas-route ("prfaas" | "local"), "" when absent
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Counts:
    sent: int
    by_outcome: dict[str, int]
    errors_by_status: dict[str, int]
    lost: int  # planned and sent, but no result recorded
    duplicates: int  # results recorded twice for one request (a runner bug; makes the counts untrustworthy)
    max_elapsed_s: float
    by_route: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.lost == 0 and self.duplicates == 0 and all(self.by_outcome[v] == 0 for v in VIOLATIONS)

    def to_json(self) -> dict:
        return {"sent": self.sent, "completed": self.by_outcome[OK], "errored": self.by_outcome[ERROR],
                **{k: v for k, v in self.by_outcome.items() if k not in (OK, ERROR)}, "lost": self.lost,
                "duplicates": self.duplicates, "errors_by_status": self.errors_by_status,
                "ok_by_route": self.by_route, "max_elapsed_s": round(self.max_elapsed_s, 2), "clean": self.clean}


def count(sent_indices: list[int], results: list[RequestResult]) -> Counts:
    """Counts over `results`; `sent_indices` are the requests actually sent (each exactly once)."""
    seen = Counter(r.index for r in results)
    # How errors reached the client: "502", "503", "200-abort" (SGLang's in-band abort), ...
    errors = Counter("200-abort" if r.status == 200 else str(r.status) for r in results if r.outcome == ERROR)
    by_outcome = Counter({o: 0 for o in OUTCOMES})
    by_outcome.update(r.outcome for r in results)
    routes = Counter(r.route or "-" for r in results if r.outcome == OK)
    return Counts(
        sent=len(sent_indices), by_outcome=dict(by_outcome), errors_by_status=dict(errors),
        lost=sum(1 for i in set(sent_indices) if i not in seen),
        duplicates=sum(n - 1 for n in seen.values() if n > 1),
        max_elapsed_s=max((r.elapsed_s for r in results), default=0.0), by_route=dict(routes))

