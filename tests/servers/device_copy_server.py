"""A stand-in for a GPU server's process, for the driver's copy parked (`handshake.park_driver_copy_when_asked`):
a plain HTTP server on $VOLGA_SERVER_PORT that plays its CUDA driver's part when told. `POST /checkpoint` puts its
"device memory" into a fresh anonymous mapping of its host memory (COPY_MIB of a seeded pattern, as the driver's
checkpoint fills one); `POST /restore` checks that mapping against the pattern (409 if it differs) and unmaps it, as
the driver's restore gives its copy back; `GET /answer` answers a value computed at start. Like vLLM's sleep mode,
`POST /sleep?level=N` sets it to sleep (its answer 503 until `POST /wake_up`), and `GET /events` lists the sleeps
and wake-ups it has had; neither can run while its "device memory" is checkpointed (409), as a CUDA process under
the driver's checkpoint cannot. It knows nothing of Volga: run it through `python -m volga_agent.worker.handshake`
to have its copy parked."""

from __future__ import annotations

import hashlib
import http.server
import mmap
import os

COPY_MIB = 96
PATTERN = hashlib.sha256(b"device memory").digest() * (2**20 // 32)  # one MiB
ANSWER = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in range(100_000))).hexdigest().encode()
copy: list[mmap.mmap] = []
events: list[str] = []  # "sleep N" and "wake", in order


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/answer" and events and events[-1] != "wake":
            self._answer(503, b"asleep: POST /wake_up first")
        elif self.path == "/events":
            self._answer(200, ",".join(events).encode())
        else:
            self._answer(200 if self.path in ("/health", "/answer") else 404,
                         ANSWER if self.path == "/answer" else b"ok")

    def do_POST(self) -> None:
        if self.path == "/checkpoint" and not copy:
            region = mmap.mmap(-1, COPY_MIB * 2**20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for at in range(0, len(region), len(PATTERN)):
                region[at:at + len(PATTERN)] = PATTERN
            copy.append(region)
            self._answer(200, b"checkpointed")
        elif self.path == "/restore" and copy:
            region = copy.pop()
            intact = all(region[at:at + len(PATTERN)] == PATTERN for at in range(0, len(region), len(PATTERN)))
            region.close()
            self._answer(200 if intact else 409, b"restored" if intact else b"the copy differs")
        elif self.path.startswith("/sleep?level=") and not copy and (not events or events[-1] == "wake"):
            events.append(f"sleep {self.path.rpartition('=')[2]}")
            self._answer(200, b"asleep")
        elif self.path == "/wake_up" and not copy and events and events[-1] != "wake":
            events.append("wake")
            self._answer(200, b"awake")
        else:
            self._answer(409, b"not now")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["VOLGA_SERVER_PORT"])), Handler).serve_forever()
