"""Ask the text-direction classifier whether lines of text are upright, through Volga's gateway.

    python examples/vision/client.py [--url 127.0.0.1:8001]

`classify` takes any `infer(model_id, inputs) -> outputs` function: `triton_infer` sends the request with
tritonclient (gRPC) to `volga up`; the same code runs onnxruntime directly for comparison.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

MODEL = "text-direction"
INPUT, OUTPUT = "x", "save_infer_model/scale_0.tmp_1"
Infer = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def text_image(text: str, upside_down: bool = False) -> Image.Image:
    image = Image.new("RGB", (12 * len(text) + 16, 32), "white")
    ImageDraw.Draw(image).text((8, 10), text, fill="black")
    return image.rotate(180) if upside_down else image


def preprocess(images: list[Image.Image]) -> np.ndarray:
    """[N, 3, 48, 192] FP32 in [-1, 1], as PaddleOCR's classifier was trained."""
    batch = [np.asarray(img.convert("RGB").resize((192, 48)), dtype=np.float32) for img in images]
    return ((np.stack(batch) / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).astype(np.float32)


def classify(infer: Infer, images: list[Image.Image]) -> np.ndarray:
    """Probabilities [N, 2]: column 0 upright, column 1 upside down."""
    return infer(MODEL, {INPUT: preprocess(images)})[OUTPUT]


def triton_infer(url: str) -> Infer:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)

    def infer(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model, tensors)
        return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response(as_json=True)["outputs"]}

    return infer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="127.0.0.1:8001", help="the gateway's gRPC address")
    args = parser.parse_args()
    lines = [text_image("Volga keeps models frozen"), text_image("Volga keeps models frozen", upside_down=True)]
    for p in classify(triton_infer(args.url), lines):
        print(f"upright {p[0]:.3f}  upside down {p[1]:.3f}")
