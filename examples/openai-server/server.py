"""An OpenAI-compatible completions server that knows nothing of Volga, the shape of an LLM server (vLLM and the
like): `POST /v1/completions` answers at once or, with `"stream": true`, token by token as server-sent events;
`GET /v1/models` lists its one model; `GET /health` answers once it serves. Like vLLM's sleep mode,
`POST /sleep?level=1` puts the weights aside in host memory and `level=2` drops them (read again from the checkpoint
at wake-up), and `POST /wake_up` brings them back; asleep, it answers 503.

Its "model" is a toy: a byte-level table of seeded random weights scoring the next byte after the last two, decoded
greedily, so that every answer to a prompt is the same. Its checkpoint, toy-llm.npy (64 MiB) in the folder it runs
in, is written by its first start when missing, as a download would; a cluster node's agent mounts its models
folder read-only, so copy the file there with server.py (after one run here). Run it as Volga does (modelspec.yaml):

    python -m uvicorn server:app --port 8080 --loop asyncio
"""

from __future__ import annotations

import json
import pathlib
import time
import uuid
from collections.abc import Iterator

import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

MODEL = "toy-llm"
CHECKPOINT = pathlib.Path("toy-llm.npy")
VOCAB = 256  # one token per byte; lower-case letters and spaces only are ever chosen
STEP_MS = 20  # a decoding step's time, as a real model takes (the toy's own takes none)


def make_checkpoint() -> np.ndarray:
    """The next byte's scores after every pair of bytes."""
    rng = np.random.default_rng(2026)
    scores = rng.standard_normal((VOCAB * VOCAB, VOCAB)).astype(np.float32)
    printable = np.zeros(VOCAB, dtype=bool)
    printable[ord("a"):ord("z") + 1] = printable[ord(" ")] = True
    scores[:, ~printable] = -np.inf
    return scores


def load_weights() -> np.ndarray:
    if not CHECKPOINT.exists():
        partial = CHECKPOINT.with_suffix(".partial.npy")
        np.save(partial, make_checkpoint())
        partial.rename(CHECKPOINT)
    weights: np.ndarray = np.load(CHECKPOINT)
    return weights


class Engine:
    def __init__(self) -> None:
        self.weights: np.ndarray | None = load_weights()
        self.host_copy: np.ndarray | None = None
        self.level = 0

    def sleep(self, level: int) -> None:
        if self.level:
            return
        if level == 1:
            self.host_copy = self.weights  # kept aside: a wake-up copies it back instead of loading again
        self.weights = None
        self.level = level

    def wake_up(self) -> None:
        if self.level:
            self.weights = self.host_copy if self.level == 1 else load_weights()
            self.host_copy, self.level = None, 0

    def tokens(self, prompt: str, max_tokens: int) -> Iterator[str]:
        """The greedy continuation of `prompt`, a token at a time; 503 at once while asleep."""
        if self.weights is None:
            raise HTTPException(503, "asleep: POST /wake_up first")
        return _decode(self.weights, prompt.encode().rjust(2)[-2:], max_tokens)


def _decode(weights: np.ndarray, context: bytes, max_tokens: int) -> Iterator[str]:
    before, last = context
    for _ in range(max_tokens):
        time.sleep(STEP_MS / 1000)
        before, last = last, int(np.argmax(weights[before * VOCAB + last]))
        yield chr(last)


engine = Engine()
app = FastAPI()


class Completion(BaseModel):
    model: str = MODEL
    prompt: str
    max_tokens: int = 16
    stream: bool = False


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/v1/models")
def models() -> dict[str, object]:
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "example"}]}


@app.post("/sleep")
def sleep(level: int = 1) -> dict[str, int]:
    if level not in (1, 2):
        raise HTTPException(400, f"level: 1 or 2, not {level}")
    engine.sleep(level)
    return {"level": level}


@app.post("/wake_up")
def wake_up() -> dict[str, int]:
    engine.wake_up()
    return {"level": engine.level}


def _choice(text: str, finish: str | None) -> dict[str, object]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


@app.post("/v1/completions", response_model=None)
def completions(request: Completion) -> dict[str, object] | StreamingResponse:
    tokens = engine.tokens(request.prompt, request.max_tokens)  # 503 here while asleep, before any event
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": MODEL}
    if not request.stream:
        return {**head, "choices": [_choice("".join(tokens), "length")]}

    def events() -> Iterator[str]:
        for token in tokens:
            yield f"data: {json.dumps({**head, 'choices': [_choice(token, None)]})}\n\n"
        yield f"data: {json.dumps({**head, 'choices': [_choice('', 'length')]})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
