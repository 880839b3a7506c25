"""Errors in OpenAI's JSON: what a client gets for a request the server refuses (`APIError`), and
the 422 for a field of the wrong type or range (`invalid`)."""

from __future__ import annotations


class APIError(Exception):
    """An error the client gets as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
                     415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                     503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(422, f"{param}: {message}", param)
