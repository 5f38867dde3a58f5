"""APIError: every failure a client sees, as an OpenAI-shaped body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Messages are one line, written for the client: never a traceback, a file path or a repr of
server state.
"""
from __future__ import annotations

# status -> OpenAI's error type for it
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # (OpenAI's type for an unknown model or route too)
    413: "invalid_request_error",
    500: "server_error",
    503: "server_overloaded",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
