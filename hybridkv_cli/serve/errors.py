"""Every error a client sees: OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
with its HTTP status; the package's one-line errors mapped to one."""

from __future__ import annotations

from hybridkv_cli.io.errors import ContextLengthError, HybridKVError, MediaError, OutOfMemoryError, UsageError


class ApiError(Exception):
    """A request refused or failed: ``status`` and the body's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_error(error: BaseException) -> ApiError:
    """The client's view of a failure while answering: the package's errors are one line each;
    anything else is an internal error whose details stay in the server's log."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, (UsageError, ContextLengthError)):
        return ApiError(400, error.reason, code="context_length_exceeded" if isinstance(
            error, ContextLengthError) else None)
    if isinstance(error, MediaError):  # it looked like media but did not decode
        return ApiError(422, error.reason, code="invalid_media")
    if isinstance(error, OutOfMemoryError):
        return ApiError(503, error.reason, type="server_error", code="out_of_memory", headers={"Retry-After": "5"})
    if isinstance(error, HybridKVError):
        return ApiError(500, error.reason, type="server_error")
    return ApiError(500, "internal error while answering (see the server's log)", type="server_error")
