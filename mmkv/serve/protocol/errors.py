"""The OpenAI error object and the refusals a request can get, each with its HTTP status: the status follows the
exception's type, never its text."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "ApiError",
    "BadRequest",
    "Busy",
    "ErrorBody",
    "ErrorDetail",
    "InternalError",
    "MethodNotAllowed",
    "NotFound",
    "RequestTimeout",
    "Timeout",
    "TooLarge",
    "Unauthorized",
    "error_from_validation",
]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class ApiError(Exception):
    """A refusal: its HTTP status and its OpenAI error object. Subclasses fix the status."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        """The error object, as JSON."""
        return ErrorBody(
            error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        ).model_dump()


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status, kind = 401, "invalid_api_key"


class NotFound(ApiError):
    status, kind = 404, "not_found_error"


class MethodNotAllowed(ApiError):
    status = 405


class RequestTimeout(ApiError):
    status, kind = 408, "timeout"


class TooLarge(ApiError):
    status = 413


class Busy(ApiError):
    status, kind = 503, "server_busy"


class Timeout(ApiError):
    status, kind = 504, "timeout"


class InternalError(ApiError):
    status, kind = 500, "server_error"


def error_from_validation(error: ValidationError) -> BadRequest:
    """The 400 for a request that does not fit the schema: OpenAI's message for an unknown field, else the first
    problem with its dotted location as ``param``."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return BadRequest(
            f"Unrecognized request argument supplied: {location}", location, "unrecognized_argument"
        )
    message = first.get("msg", "invalid value")
    return BadRequest(f"{location}: {message}" if location else message, location or None, "invalid_value")
