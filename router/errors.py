"""The router's error answers: OpenAI-style ``{"error": {"message", "type", "code"}}`` bodies."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "code"}}``; ``headers`` go with it
    (``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str = "",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code or type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def bad(message: str, code: str = "invalid_request_error") -> ApiError:
    """A 400: the request is at fault."""
    return ApiError(400, message, "invalid_request_error", code)
