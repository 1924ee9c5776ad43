"""Requests from web pages of other sites are refused (403). A page's script can POST to any
server this machine reaches, ``localhost`` included, without asking first: a ``text/plain``
body needs no CORS preflight, and the server would run it (the page could not read the reply,
but it could spend the server's time, or send a chat under the user's name). Browsers send an
``Origin`` header with such requests and page scripts cannot remove it; curl, the ``openai``
client and other SDKs send none, and the chat page at ``/`` sends its own (this server's).

A page can also reach a server on a loopback address under its own site's name, by DNS
rebinding (the name first resolves to the site, then to 127.0.0.1): its requests are then
same-origin. A server on a loopback address answers only requests for loopback names
(``localhost``, ``127.0.0.1``, ``[::1]``) and the names given with ``--allow-host``; one
listening on other addresses is reachable by any name and answers any Host."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from llm_foundry.serve.fields import as_json, error_body


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (an Origin header: scheme://host[:port]) names the server the request
    reached (its Host header), by host and port (the scheme is left out: behind a proxy that
    ends TLS, a page at https:// reaches this server over http); "null" (a sandboxed or file:
    page) names none."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return parts.netloc.lower() == host.lower()


def host_allowed(host: str, names: frozenset[str] | None) -> bool:
    """Whether a Host header (name[:port]) is one the server answers: any where ``names`` is
    None; else a loopback name or address (localhost, *.localhost, 127.0.0.0/8, ::1) or one of
    ``names``."""
    if names is None:
        return True
    name = urlsplit("//" + host).hostname or ""  # lowercased; [::1] unbracketed
    if name == "localhost" or name.endswith(".localhost") or name in names:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class SameOrigin:
    """ASGI middleware: answer 403 (OpenAI's error body) to a request whose Origin header is
    another site's, or whose Host header ``host_allowed`` refuses for ``hosts``; everything else
    goes on to ``app``."""

    def __init__(self, app, hosts: frozenset[str] | None = None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            host = headers.get(b"host", b"").decode("latin-1")
            code = message = None
            if b"origin" in headers and not same_origin(origin, host):
                code = "cross_origin"
                message = (
                    f"a request from the web page at {as_json(origin)} (its Origin header) is "
                    "refused: this server answers its own page at / and clients that send no "
                    "Origin (curl, SDKs)"
                )
            elif b"host" in headers and not host_allowed(host, self.hosts):
                code = "host_not_allowed"
                message = (
                    f"a request for the host {as_json(host)} (its Host header) is refused: "
                    "this server listens on a loopback address and answers localhost and "
                    "loopback addresses (another name this machine has: --allow-host NAME)"
                )
            if code is not None:
                answer = JSONResponse(error_body(message, code=code), 403)
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)
