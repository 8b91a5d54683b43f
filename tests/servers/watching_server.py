"""An HTTP server that holds an inotify watch (as servers that reload on file changes do): CRIU cannot dump it."""

from __future__ import annotations

import ctypes
import http.server
import os

libc = ctypes.CDLL(None, use_errno=True)
watch = libc.inotify_init1(os.O_CLOEXEC)
libc.inotify_add_watch(watch, b".", 0x100)  # IN_CREATE


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


http.server.HTTPServer(("127.0.0.1", int(os.environ["VOLGA_SERVER_PORT"])), Handler).serve_forever()
