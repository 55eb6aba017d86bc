"""The error a request is refused with: an HTTP status and OpenAI's error body."""

from __future__ import annotations

from typing import Any

__all__ = ["RETRY_AFTER_SECONDS", "ApiError"]

RETRY_AFTER_SECONDS = 1
"""What ``Retry-After`` tells a client refused for a full queue, too many connections or a drain."""


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields.

    Args:
        status: the HTTP status (4xx for the client's mistakes, 5xx for the server's).
        message: a sentence for the client.
        param: the request field at fault, if one is.
        code: a machine-readable code (``context_length_exceeded``, ``invalid_type``...).
        type: OpenAI's error type (``invalid_request_error`` unless the server is at fault).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
