"""Network safety of the server: API keys, a bound on request bodies, and a deadline for slow clients. `Guard` holds
the settings and `GuardMiddleware` applies them, in every app serving/app.py's `build_app` makes (this process's, and
Ray Serve's ingress).

Contract, per HTTP request, before any route runs:

* With API keys, every path but /health needs one, as `Authorization: Bearer <key>` (or llama-server's `X-Api-Key`),
  compared in constant time with every key (`hmac.compare_digest`); else a 401 in OpenAI's error shape (code
  `invalid_api_key`, header `WWW-Authenticate: Bearer`), sent before the body is read. No key is ever logged, and
  `Guard`'s repr does not show them.
* The body is read here, whole, before the route sees it: a `Content-Length` over `max_body_bytes` is a 413 at once;
  a chunked body is counted as it arrives and refused (413) at the first byte over the limit; a body that has not
  arrived whole within `timeout` seconds is a 408. So a slow sender never reaches the scheduler (no job, no slot).
  These three close the connection.
* Every write to the client must complete within `timeout` seconds: a client that does not read (uvicorn's flow
  control holds the write once its buffers are full) is cut off, and the response's generations are cancelled
  (a stream's `EventStream` cancels its jobs however it ends), so it holds no decoding slot.

`warn_if_exposed` logs a warning when the server listens beyond the loopback without a key.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speculor.errors import SpeculorError
from speculor.serving.errors import APIError

logger = logging.getLogger("speculor.serving.app")  # the server's one log channel

MAX_BODY_BYTES = 4 * 2**20  # a request body's bytes at most (a long prompt as text is far below)
TIMEOUT_S = 60.0  # a body's arrival, and each write to the client, at most (llama-server's --timeout)
OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers' health checks)


@dataclass(frozen=True)
class Guard:
    """What `GuardMiddleware` enforces: `api_keys` (none: no key asked), `max_body_bytes`, `timeout` (seconds)."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_bytes: int = MAX_BODY_BYTES
    timeout: float = TIMEOUT_S

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k or k != k.strip() for k in self.api_keys):
            raise SpeculorError("an API key must be a non-empty string without surrounding spaces")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise SpeculorError(f"--max-body-bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not self.timeout > 0:
            raise SpeculorError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")

    def authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether the request's headers carry one of the keys (every key compared, in constant time each)."""
        given = _given_key(headers)
        ok = False
        for key in self.api_keys:
            ok |= given is not None and hmac.compare_digest(given, key.encode())
        return ok


def _given_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request gives: `Authorization: Bearer <key>`, else `X-Api-Key: <key>`; None for none."""
    found = dict((k.lower(), v) for k, v in headers)
    scheme, _, token = found.get(b"authorization", b"").strip().partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return found.get(b"x-api-key", b"").strip() or None


def read_keys(keys: Iterable[str] = (), key_file: str | None = None) -> tuple[str, ...]:
    """The API keys given: each `--api-key` (comma-separated keys, as llama-server takes them) and the lines of
    `--api-key-file` (one key a line; blank lines and lines starting with # skipped). Raises SpeculorError."""
    out = [k.strip() for given in keys for k in given.split(",")]
    if key_file is not None:
        try:
            lines = Path(key_file).expanduser().read_text().splitlines()
        except OSError as exc:
            raise SpeculorError(f"--api-key-file {key_file}: {exc.strerror or exc}") from None
        out += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not out:
            raise SpeculorError(f"--api-key-file {key_file} holds no key")
    if any(not k for k in out):
        raise SpeculorError("--api-key: an empty key")
    return tuple(dict.fromkeys(out))


def loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, guard: Guard) -> None:
    if not loopback(host) and not guard.api_keys:
        logger.warning("listening on %s without an API key: anyone who reaches this address can use the server; "
                       "give --api-key or --api-key-file (and --ssl-key-file/--ssl-cert-file for TLS)", host)


class ClientStalled(Exception):
    """A write to the client did not complete within the timeout: the client does not read."""


class GuardMiddleware:
    """The ASGI middleware that enforces a `Guard` (module docstring)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refused(scope)
        if refused is None:
            body = await self._body(receive)
            if body is None:  # the client left while sending
                return
            refused = body if isinstance(body, APIError) else None
        if refused is not None:
            response = refused.response()
            response.headers["connection"] = "close"  # the body may not have been read: no next request on it
            if refused.status == 401:
                response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, _replay(body, receive), self._in_time(send))
        except ClientStalled:
            logger.warning("a client of %s did not read its response for %g s: cut off, its generation cancelled",
                           scope["path"], self.guard.timeout)

    def _refused(self, scope: Scope) -> APIError | None:
        """The answer to a request refused on its headers (no key, a declared body too long), else None."""
        g = self.guard
        if g.api_keys and scope["path"] not in OPEN_PATHS and not g.authorized(scope["headers"]):
            given = _given_key(scope["headers"]) is not None
            return APIError(401, ("Incorrect API key provided" if given else "Missing API key: give it as "
                                  "'Authorization: Bearer <key>'"), code="invalid_api_key")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "Content-Length is not a number", code="invalid_body")
            if int(length) > g.max_body_bytes:
                return too_large(g.max_body_bytes)
        return None

    async def _body(self, receive: Receive) -> bytes | APIError | None:
        """The whole request body; an APIError (413, 408) for one too long or too slow; None if the client left."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.guard.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.guard.max_body_bytes:
                        return too_large(self.guard.max_body_bytes)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return APIError(408, f"the request body did not arrive within {self.guard.timeout:g} s (--timeout)",
                            code="request_timeout")

    def _in_time(self, send: Send) -> Send:
        timeout = self.guard.timeout

        async def send_in_time(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        return send_in_time


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read already, then the client's next messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
