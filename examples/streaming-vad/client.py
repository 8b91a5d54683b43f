"""Stream audio through Silero VAD on Volga, feeding the model's state back on every chunk.

    python examples/streaming-vad/client.py [--url 127.0.0.1:8001]

The model is stateless on the server: the client owns the stream's state (the RNN state `stateN` and the last 64
samples of audio, the model's context) and sends it with the next chunk. `stream` takes any
`infer(model_id, inputs) -> outputs` function, so the same loop runs against onnxruntime directly.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

MODEL = "silero-vad"
RATE, CHUNK, CONTEXT = 16000, 512, 64
Infer = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def stream(infer: Infer, audio: np.ndarray, model: str = MODEL) -> list[float]:
    """The speech probability of each 512-sample chunk of 16 kHz mono audio (FP32 in [-1, 1])."""
    state = np.zeros((2, 1, 128), dtype=np.float32)
    context = np.zeros((1, CONTEXT), dtype=np.float32)
    probabilities = []
    for start in range(0, len(audio) - CHUNK + 1, CHUNK):
        chunk = audio[start:start + CHUNK].astype(np.float32)[None, :]
        frame = np.concatenate([context, chunk], axis=1)
        out = infer(model, {"input": frame, "state": state, "sr": np.array(RATE, dtype=np.int64)})
        state = out["stateN"]  # fed back with the next chunk
        context = frame[:, -CONTEXT:]
        probabilities.append(float(out["output"][0, 0]))
    return probabilities


def test_audio(seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """Silence, then a voiced-like harmonic burst with noise, then silence."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    voiced = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate((140, 280, 420, 560, 700)))
    envelope = ((t > seconds / 4) & (t < 3 * seconds / 4)).astype(np.float64)
    return (0.3 * voiced * envelope * (1 + 0.5 * np.sin(2 * np.pi * 4 * t)) + 0.01 * rng.standard_normal(len(t))
            ).astype(np.float32)


def triton_infer(url: str) -> Infer:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    dtypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.float16): "FP16"}

    def infer(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), dtypes[array.dtype])
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model, tensors)
        return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response(as_json=True)["outputs"]}

    return infer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="127.0.0.1:8001", help="the gateway's gRPC address")
    args = parser.parse_args()
    for i, p in enumerate(stream(triton_infer(args.url), test_audio())):
        print(f"{i * CHUNK / RATE:6.2f} s  {'#' * int(p * 40):<40} {p:.2f}")
