"""An aiohttp app that knows nothing of Volga, as a user places it in a node's models folder: it needs only what the
agent's image already has (Python, aiohttp, NumPy). It streams its answer token by token as server-sent events, in
chunks, and answers whole on /v1/generate; every answer to a prompt is the same.

    python aiohttp_stream_server.py --unix PATH     # or --port N   [--hold-mib N: N MiB of "weights" held]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json

import numpy as np
from aiohttp import web


def tokens(prompt: str, count: int) -> list[str]:
    """The "model": each token from a hash of the prompt and the tokens before it, the same every time."""
    out: list[str] = []
    for _ in range(count):
        digest = hashlib.sha256(" ".join([prompt, *out]).encode()).digest()
        out.append(f"tok{int.from_bytes(digest[:2], 'little') % 256}")
    return out


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def generate(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"tokens": tokens(body["prompt"], int(body.get("tokens", 8)))})


async def stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    for token in tokens(body["prompt"], int(body.get("tokens", 8))):
        await reply.write(f"data: {json.dumps({'token': token})}\n\n".encode())
        await asyncio.sleep(int(body.get("delay_ms", 0)) / 1000)
    await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--unix", help="listen on this Unix socket")
    where.add_argument("--port", type=int, help="listen on this TCP port of 127.0.0.1")
    parser.add_argument("--hold-mib", type=int, default=0, help="hold this much memory written, as weights are")
    args = parser.parse_args()
    app = web.Application()
    app["weights"] = np.random.default_rng(3).integers(0, 255, args.hold_mib << 20, dtype=np.uint8)
    app.add_routes([web.get("/health", health), web.post("/v1/generate", generate), web.post("/v1/stream", stream)])
    web.run_app(app, path=args.unix, host=None if args.unix else "127.0.0.1", port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
