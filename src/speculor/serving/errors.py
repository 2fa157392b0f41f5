"""OpenAI-style errors of the server: `APIError` and the FastAPI handlers that answer every error with one.

Contract: every error leaves as `{"error": {"message", "type", "param", "code"}}` with its HTTP status: 400
for bad input (a request validation error, or a `SpeculorError` from the library), 404/405 for unknown
routes and methods, 429 (with `Retry-After: 1`) when the queue is full, 500 with no details for a server bug
(logged with its traceback).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculor.errors import SpeculorError

logger = logging.getLogger("speculor.serving.app")  # the server's one log channel


class APIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(exc: SpeculorError, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, str(exc), param=param, code=code)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A pydantic error location without 'body' and cut at the first union-member tag ('str', 'list[int]')."""
    path: list[str] = []
    for part in loc:
        text = str(part)
        if part == "body" and not path:
            continue
        if isinstance(part, str) and ("[" in text or text in {"str", "int", "float", "bool", "none"}
                                      or text[:1].isupper()):
            break
        path.append(text)
    return path


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first invalid field as a 400 (the messages of all union branches for it); malformed JSON apart."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"malformed JSON in the request body: {detail}", code="json_invalid")
    path = _field_path(first.get("loc", ()))
    if not path and first.get("type") == "model_attributes_type":
        return APIError(400, "the request body must be a JSON object", code="invalid_body")
    msgs = list(dict.fromkeys(e["msg"] for e in errors if _field_path(e.get("loc", ())) == path))
    msg = msgs[0] + "".join(f", or {m[:1].lower()}{m[1:]}" for m in msgs[1:])
    where = ".".join(path) or "request body"
    return APIError(400, f"{where}: {msg}", param=path[0] if path else None, code=first.get("type"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; an unexpected exception is logged and answered 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(SpeculorError)
    async def _speculor(request: Request, exc: SpeculorError) -> JSONResponse:
        return bad_request(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", type="server_error").response()
