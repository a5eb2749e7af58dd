"""Errors in OpenAI's shape, and the chat pipeline's error codes as HTTP statuses."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.retry_after_s = param, code, retry_after_s

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(self.retry_after_s)))}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


UNAVAILABLE = ApiError(
    503, "the database is not answering; try again shortly", "server_error",
    code="unavailable", retry_after_s=5,
)  # fmt: skip

# The chat pipeline's error codes as HTTP statuses.
STATUS = {
    "not_found": 404,
    "too_long": 400,
    "conflict": 409,
    "busy": 429,
    "bad_request": 400,
    "rejected": 400,
    "pin_refused": 400,
    "unavailable": 503,
}


def pipeline_error(code: str, message: str, retry_after_s: float | None) -> ApiError:
    status = STATUS.get(code, 500)
    if status == 429:
        return ApiError(429, message, "rate_limit_error", code="rate_limit_exceeded",
                        retry_after_s=retry_after_s or 1.0)  # fmt: skip
    if code == "too_long":
        return ApiError(400, message, param="messages", code="context_length_exceeded")
    if code == "pin_refused":
        return ApiError(400, message, param="retention", code="pin_cap_exceeded")
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, message, kind, code=code)
