"""A plain HTTP server that takes part in Volga's checkpoint handshake: it loads, offers its image
(`handshake.checkpoint_here()`, before it opens any socket) and then listens on $VOLGA_SERVER_PORT.
It answers GET /health and GET /answer (a value computed at load) and counts the requests it served."""

from __future__ import annotations

import hashlib
import http.server
import os

from volga_agent.worker import handshake

ANSWER = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in range(200_000))).hexdigest()
handshake.checkpoint_here()
served = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        global served
        served += 1
        body = {"/health": b"ok", "/answer": ANSWER.encode(), "/served": str(served).encode()}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer(("127.0.0.1", int(os.environ["VOLGA_SERVER_PORT"])), Handler).serve_forever()
