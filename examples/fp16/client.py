"""Stream audio through the half-precision Silero VAD on Volga, feeding the state back on every chunk.

    python examples/fp16/client.py [--url 127.0.0.1:8001]

The loop is the streaming example's (examples/streaming-vad/client.py) without the sample-rate input, which this
16 kHz-only model does not take.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

MODEL = "silero-vad-half"
CHUNK, CONTEXT = 512, 64
Infer = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def stream(infer: Infer, audio: np.ndarray, model: str = MODEL) -> list[float]:
    """The speech probability of each 512-sample chunk of 16 kHz mono audio."""
    state = np.zeros((2, 1, 128), dtype=np.float32)
    context = np.zeros((1, CONTEXT), dtype=np.float32)
    probabilities = []
    for start in range(0, len(audio) - CHUNK + 1, CHUNK):
        frame = np.concatenate([context, audio[None, start:start + CHUNK].astype(np.float32)], axis=1)
        out = infer(model, {"input": frame, "state": state})
        state, context = out["stateN"], frame[:, -CONTEXT:]
        probabilities.append(float(out["output"][0, 0]))
    return probabilities


def triton_infer(url: str) -> Infer:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)

    def infer(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = []
        for name, array in inputs.items():
            tensor = httpclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array, binary_data=True)
            tensors.append(tensor)
        result = client.infer(model, tensors)
        return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}

    return infer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="127.0.0.1:8000", help="the gateway's HTTP address")
    args = parser.parse_args()
    t = np.arange(32000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) * (t > 0.5)).astype(np.float32)
    print(stream(triton_infer(args.url), audio))
