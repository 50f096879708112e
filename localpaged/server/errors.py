"""Error bodies in the style of the API a path belongs to: OpenAI's under /v1, Ollama's elsewhere."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("localpaged.server")

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def is_openai_path(path: str) -> bool:
    """Whether a path belongs to the OpenAI-compatible part (so gets OpenAI-style errors)."""
    return path.startswith("/v1/") or path == "/v1"


def error_body(path: str, status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """`{"error": {...}}` for OpenAI paths, `{"error": "..."}` for Ollama's and the rest."""
    if is_openai_path(path):
        return {"error": {"message": message,
                          "type": _OPENAI_TYPES.get(status, "server_error" if status >= 500
                                                    else "invalid_request_error"),
                          "param": param, "code": code}}
    return {"error": message}


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON error response in the style of `path`'s API."""
    return JSONResponse(error_body(path, status, message, param=param, code=code),
                        status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for the first validation error, and the parameter it names."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union branch names (e.g. "str", "list[...]") from the location.
    loc = [p for p in loc if not any(ch in p for ch in "[]") and p not in
           ("str", "int", "float", "bool", "dict", "list", "function-after", "tagged-union")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if param is None:
        return f"invalid request body: {msg}", None
    return f"invalid value for '{param}': {msg}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map our errors, validation failures and stray HTTP errors to API-style bodies."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message,
                              param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(request.url.path, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")
