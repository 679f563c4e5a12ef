"""ASGI middleware that refuses request bodies over a byte limit while they stream in.

A declared `Content-Length` over the limit is answered 413 before any byte is read; a body without
one (chunked) is counted as it arrives and refused the moment it passes the limit, so no handler
ever holds more than `max_bytes` of one request. 413 is a client error: the SDK does not retry it.
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
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self.refuse(send)
            return
        seen, tripped = 0, False

        async def counted() -> Message:
            nonlocal seen, tripped
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
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
        return f"request body is larger than this server's limit of {self.max_bytes} bytes"

    async def refuse(self, send: Send) -> None:
        body = json.dumps({"detail": self.detail()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
