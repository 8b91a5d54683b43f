"""Stream a completion from a model server behind Volga's gateway, as any OpenAI-compatible client does, with the
header that names the model. Run: python client.py GATEWAY_URL [PROMPT]  (GATEWAY_URL: volga up's http endpoint)."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator

MODEL = "toy-llm"


def stream(gateway: str, prompt: str, max_tokens: int = 16) -> Iterator[str]:
    """The completion's text, piece by piece as the server-sent events arrive."""
    request = urllib.request.Request(
        f"{gateway}/v1/completions", data=json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                       "stream": True}).encode(),
        headers={"Content-Type": "application/json", "x-model-id": MODEL})
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            data = line.decode().strip().removeprefix("data: ")
            if not line.startswith(b"data: ") or data == "[DONE]":
                continue
            text = json.loads(data)["choices"][0]["text"]
            if text:  # the last event only says why it ended
                yield text


if __name__ == "__main__":
    for piece in stream(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "the river"):
        print(piece, end="", flush=True)
    print()
