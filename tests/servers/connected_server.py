"""A plain HTTP server that holds a TCP connection open to another service (a database, a cache), as many servers do.
It connects to 127.0.0.1:$PEER_PORT at start. GET /ask sends the peer a line and answers with the peer's reply; a
connection found broken (as after a restore that closed it) is made again once, and the answer says so. POST
/disconnect and POST /connect close and open it (hooks around a checkpoint). Listens on $VOLGA_SERVER_PORT."""

from __future__ import annotations

import http.server
import json
import os
import socket

PEER = ("127.0.0.1", int(os.environ["PEER_PORT"]))
state: dict[str, object] = {"peer": socket.create_connection(PEER), "reconnects": 0}


def ask() -> bytes:
    for attempt in range(2):
        peer = state["peer"]
        try:
            if not isinstance(peer, socket.socket):
                raise ConnectionError("not connected")
            peer.sendall(b"ping\n")
            reply = peer.recv(64)
            if not reply:
                raise ConnectionError("closed by the peer")
            return reply
        except OSError:
            if attempt:
                raise
            state["peer"] = socket.create_connection(PEER)
            state["reconnects"] = int(str(state["reconnects"])) + 1
    raise AssertionError("unreachable")


class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(b"ok")
        elif self.path == "/ask":
            reply = ask().decode().strip()
            self._answer(json.dumps({"peer": reply, "reconnects": state["reconnects"]}).encode())
        else:
            self._answer(b"", 404)

    def do_POST(self) -> None:
        peer = state["peer"]
        if self.path == "/disconnect" and isinstance(peer, socket.socket):
            peer.close()
            state["peer"] = None
        elif self.path == "/connect" and state["peer"] is None:
            state["peer"] = socket.create_connection(PEER)
        self._answer(b"{}")

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer(("127.0.0.1", int(os.environ["VOLGA_SERVER_PORT"])), Handler).serve_forever()
