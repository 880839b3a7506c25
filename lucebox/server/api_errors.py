"""Errors in OpenAI's JSON: what a client gets for a request the server refuses (`APIError`), and
the 422 for a field of the wrong type or range (`invalid`)."""

from __future__ import annotations

from lucebox.errors import InvalidArgumentError, LuceboxError


class APIError(Exception):
    """An error the client gets as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                     413: "invalid_request_error",
                     415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                     431: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(422, f"{param}: {message}", param)


# The request field behind each `LLM.stream` constraint keyword, for an error the grammar meets mid-output
_CONSTRAINT_FIELDS = {"json_schema": "response_format.json_schema.schema", "json_object": "response_format",
                      "grammar": "grammar"}


def mid_output_error(e: LuceboxError, req) -> APIError:
    """An engine error met after the request began: a 400 (naming the request field when it names one)
    when the request asked for what cannot be served (a grammar the vocabulary cannot write, or past
    what the grammar engine follows), else a 500."""
    if isinstance(e, InvalidArgumentError):
        field = getattr(e, "field", None)
        if field in _CONSTRAINT_FIELDS:
            field = "tools" if req.tools is not None and req.tools.constraint else _CONSTRAINT_FIELDS[field]
        return APIError(400, str(e), field)
    return APIError(500, str(e))
