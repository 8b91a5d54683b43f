"""An LLM server that knows nothing of Volga: a transformers causal LM on the GPU with a preallocated KV cache,
generating greedily and streaming its tokens as server-sent events (an OpenAI-style `POST /v1/completions`).

Its sleep mode follows vLLM's, so that Volga's hooks can call it before a checkpoint and after a restore:

    POST /sleep?level=1   offload the weights to pinned host memory and release the KV cache (their GPU memory goes
                          back to the driver); wake-up copies the weights back at the pinned rate
    POST /sleep?level=2   release the KV cache and the weights (read again from the model's file at wake-up)
    POST /wake_up         allocate the KV cache again and bring the weights back

Asleep, it answers completions with 503 and its health with 200, as vLLM does. The model folder (`LLM_MODEL_DIR`)
holds a transformers `config.json` and `model.safetensors`; `llm_model.make_model` writes one with seeded random
weights.
Tokens are bytes of the prompt (ids 3-258) in and ids out: the answers are compared, not read.

Run: LLM_MODEL_DIR=DIR uvicorn volga_bench.servers.llm_app:app --port PORT --loop asyncio --no-access-log
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from safetensors.torch import load_file
from transformers import StaticCache
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaForCausalLM

from volga_bench.servers.llm_model import WEIGHTS


class Engine:
    """The model, its KV cache and the sleep levels; one generation at a time (one cache)."""

    def __init__(self, folder: pathlib.Path, cache_tokens: int) -> None:
        self.folder, self.cache_tokens = folder, cache_tokens
        self.config = LlamaConfig.from_pretrained(folder)
        with torch.device("cuda"):  # made on the GPU (its random start is overwritten by the file's weights)
            self.model = LlamaForCausalLM(self.config).half().eval()
        self.model.requires_grad_(False)
        self._buffers = {n: b.clone() for n, b in self.model.named_buffers()}  # rotary tables: not in the file
        self._load_weights(made=True)
        self.cache: StaticCache | None = None
        self._host: dict[str, torch.Tensor] | None = None  # the weights offloaded by a level-1 sleep
        self.level = 0
        self.lock = threading.Lock()
        self._allocate_cache()

    def _load_weights(self, made: bool = False) -> None:
        if not made:
            self.model.to_empty(device="cuda")
        self.model.load_state_dict(load_file(str(self.folder / WEIGHTS)))  # mapped from the page cache, copied over
        for name, value in self._buffers.items():
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner).register_buffer(leaf, value.to("cuda"), persistent=False)

    def _allocate_cache(self) -> None:
        """The KV cache, allocated whole now (a one-token prefill makes a lazily allocated cache take its memory)."""
        try:
            self.cache = StaticCache(config=self.config, max_cache_len=self.cache_tokens)
        except TypeError:  # transformers < 4.56: the cache's shape and place given up front
            self.cache = StaticCache(config=self.config, max_batch_size=1, max_cache_len=self.cache_tokens,
                                     device="cuda", dtype=torch.float16)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device="cuda"), past_key_values=self.cache,
                       cache_position=torch.zeros(1, dtype=torch.long, device="cuda"), use_cache=True)
        torch.cuda.synchronize()

    def sleep(self, level: int) -> None:
        with self.lock:
            if self.level:
                return
            self.cache = None
            if level == 1:
                self._offload()
            else:
                self.model.to_empty(device="meta")
            gc.collect()
            torch.cuda.empty_cache()
            self.level = level

    def _offload(self) -> None:
        """The weights into pinned host memory (allocated at the first sleep, kept for the next), off the GPU."""
        params = dict(self.model.named_parameters())
        if self._host is None:
            self._host = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for n, p in params.items()}
        for name, param in params.items():
            self._host[name].copy_(param.data, non_blocking=True)
        torch.cuda.synchronize()
        for param in params.values():
            param.data = torch.empty(0, dtype=param.dtype, device="cuda")

    def _reload(self) -> None:
        assert self._host is not None
        for name, param in self.model.named_parameters():
            param.data = self._host[name].to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    def wake_up(self) -> None:
        with self.lock:
            if not self.level:
                return
            if self.level == 1:
                self._reload()
            else:
                self._load_weights()
            self._allocate_cache()
            self.level = 0

    def generate(self, prompt: str, max_tokens: int) -> Iterator[int]:
        """Greedy tokens, one by one. A streamed answer's steps run on whichever thread the web framework picks,
        so each step enters inference mode (thread-local) itself; the lock is held from the first step to the last."""
        ids = [3 + b for b in prompt.encode()][: self.cache_tokens - max_tokens] or [3]
        self.lock.acquire()
        try:
            if self.level or self.cache is None:
                raise HTTPException(503, "asleep: POST /wake_up first")
            with torch.inference_mode():  # the cache's tensors were made in it
                self.cache.reset()
            tokens = torch.tensor([ids], device="cuda")
            position = torch.arange(len(ids), device="cuda")
            for _ in range(max_tokens):
                with torch.inference_mode():
                    logits = self.model(input_ids=tokens, past_key_values=self.cache, cache_position=position,
                                        use_cache=True).logits
                    token = int(logits[0, -1].argmax())
                yield token
                tokens = torch.tensor([[token]], device="cuda")
                position = position[-1:] + 1
        finally:
            self.lock.release()


engine = Engine(pathlib.Path(os.environ["LLM_MODEL_DIR"]), int(os.environ.get("LLM_CACHE_TOKENS", "32768")))
app = FastAPI()


class Completion(BaseModel):
    prompt: str
    max_tokens: int = 16
    stream: bool = False


@app.get("/health")
def health() -> dict[str, Any]:
    return {"status": "ok", "asleep": bool(engine.level)}


@app.post("/sleep")
def sleep(level: int = 1) -> dict[str, int]:
    if level not in (1, 2):
        raise HTTPException(400, f"level: 1 or 2, not {level}")
    engine.sleep(level)
    return {"level": level}


@app.post("/wake_up")
def wake_up() -> dict[str, bool]:
    engine.wake_up()
    return {"awake": True}


@app.post("/v1/completions")
def completions(request: Completion) -> Any:
    if not 1 <= request.max_tokens <= 1024:
        raise HTTPException(400, "max_tokens: 1 to 1024")
    if engine.level:
        raise HTTPException(503, "asleep: POST /wake_up first")
    tokens = engine.generate(request.prompt, request.max_tokens)
    if not request.stream:
        return {"choices": [{"text": " ".join(str(t) for t in tokens)}]}

    def events() -> Iterator[str]:
        for token in tokens:
            yield f"data: {json.dumps({'choices': [{'text': f'{token} '}]})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
