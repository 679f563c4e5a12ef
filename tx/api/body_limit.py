"""ASGI middleware that refuses request bodies over a byte limit while they stream in.

A declared `Content-Length` over the limit is answered 413 before any byte is read; a body without
one (chunked) is counted as it arrives and refused the moment it passes the limit, so no handler
ever holds more than `max_bytes` of one request. 413 is a client error: the SDK does not retry it.

A body that may be parsed as JSON (all but protobuf bodies and upload chunks) also has its `{` and `[`
counted: parsing makes an object of each, about 64 bytes for an empty one that takes 3 on the wire, so
8 MiB of `{},` took 200 MB to parse before any check of the fields saw it. Brackets inside strings count
too, which only errs towards refusing (`max_containers` is far above what a request of the SDK holds).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Exception):
    """Raised into the handler reading a body that passed the limit."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, max_containers: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_containers = max_containers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self.refuse(send)
            return
        seen, containers, tripped = 0, 0, False
        json_like = self.max_containers is not None and _may_be_json(scope)

        async def counted() -> Message:
            nonlocal seen, containers, tripped
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                containers += body.count(b"{") + body.count(b"[") if json_like else 0
                if seen > self.max_bytes or (json_like and containers > (self.max_containers or 0)):
                    tripped = True
                    raise BodyTooLarge(self.detail())
            return message

        async def answered(message: Message) -> None:
            """Once the body passed the limit, the answer is our 413, whatever the handler made of the error:
            FastAPI's body parsing turned it into a 400 "error parsing the body" naming no limit."""
            if not tripped:
                await send(message)
            elif message["type"] == "http.response.start":
                await self.refuse(send)

        await self.app(scope, counted, answered)

    def detail(self) -> str:
        shape = f", or holds more than {self.max_containers} JSON objects and arrays" if self.max_containers else ""
        return f"request body is larger than this server's limit of {self.max_bytes} bytes{shape}"

    async def refuse(self, send: Send) -> None:
        body = json.dumps({"detail": self.detail()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _may_be_json(scope: Scope) -> bool:
    """Whether a route may parse this body as JSON: every body but a protobuf one and an upload's chunk,
    which is streamed to disk as bytes (its `{` are data)."""
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"").lower()
    chunk = scope.get("method") == "PUT" and "/files/" in scope.get("path", "")
    return b"protobuf" not in content_type and not chunk
