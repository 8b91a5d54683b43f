"""Requests for one model from a thread, one after another, for the tests that load a real gateway."""

from __future__ import annotations

import threading
from typing import Any

import tritonclient.grpc as grpcclient


class Traffic:
    """Requests for one model from a thread, one after another, until stopped."""

    def __init__(self, grpc_address: str, model: str, inputs: list[Any]) -> None:
        self.client = grpcclient.InferenceServerClient(grpc_address)
        self.model, self.inputs = model, inputs
        self.stop = threading.Event()
        self.answered = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.client.infer(self.model, self.inputs)
            self.answered += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()
