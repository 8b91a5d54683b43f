"""A FastAPI app that knows nothing of Volga: it builds a small deterministic "model" at start-up and streams its
answer token by token as server-sent events. Run: uvicorn volga_bench.servers.stream_app:app --port PORT (or --uds)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator

import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

VOCAB = [f"tok{i}" for i in range(512)]
# The start-up work a real server does (weights made and multiplied once).
_rng = np.random.default_rng(7)
_raw = _rng.standard_normal((512, 512))
WEIGHTS = (_raw @ _raw.T / 512).astype(np.float32)

app = FastAPI()
# Like vLLM's sleep mode: asleep, the server answers 503 until POST /wake_up.
state = {"asleep": False}


class Prompt(BaseModel):
    prompt: str
    tokens: int = 8
    delay_ms: int = 0  # a pause before each streamed token, as a generating model makes


def _tokens(prompt: str, count: int) -> list[str]:
    state = np.frombuffer(hashlib.sha256(prompt.encode()).digest() * 64, dtype=np.uint8)[:512].astype(np.float32)
    out = []
    for _ in range(count):
        state = np.tanh(WEIGHTS @ state / 100.0)
        out.append(VOCAB[int(np.argmax(state))])
        state = np.roll(state, 1)
    return out


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/sleep")
def sleep() -> dict[str, bool]:
    state["asleep"] = True
    return state


@app.post("/wake_up")
def wake_up() -> dict[str, bool]:
    state["asleep"] = False
    return state


def _awake() -> None:
    if state["asleep"]:
        raise HTTPException(503, "asleep: POST /wake_up first")


@app.post("/v1/generate")
def generate(prompt: Prompt) -> dict[str, list[str]]:
    _awake()
    return {"tokens": _tokens(prompt.prompt, prompt.tokens)}


@app.post("/v1/stream")
def stream(prompt: Prompt) -> StreamingResponse:
    _awake()

    def events() -> Iterator[str]:
        for token in _tokens(prompt.prompt, prompt.tokens):
            time.sleep(prompt.delay_ms / 1000)
            yield f"data: {json.dumps({'token': token})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
