"""Read the text in an image with two models on Volga: detect where the text is, crop it, recognize it.

    python examples/pipeline/client.py [--url 127.0.0.1:8001]

The client is the pipeline: it feeds the detector's output (a text-probability map) into the crop that the
recognizer reads. `read` takes any `infer(model_id, inputs) -> outputs` function, so the same steps run against
onnxruntime directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

DETECT, RECOGNIZE = "text-detection", "text-recognition"
Infer = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Reading:
    box: tuple[int, int, int, int]  # left, top, right, bottom in the image
    text_map: np.ndarray  # the detector's output
    scores: np.ndarray  # the recognizer's output: [1, columns, classes]

    def indices(self) -> list[int]:
        """Greedy CTC decoding: the best class per column, repeats merged, blanks (0) dropped."""
        best = self.scores[0].argmax(axis=1)
        return [int(c) for i, c in enumerate(best) if c != 0 and (i == 0 or c != best[i - 1])]


def text_image(text: str) -> Image.Image:
    small = Image.new("RGB", (7 * len(text) + 20, 24), "white")
    ImageDraw.Draw(small).text((10, 6), text, fill="black")
    return small.resize((small.width * 3, small.height * 3), Image.Resampling.BICUBIC)


def _normalize(image: Image.Image) -> np.ndarray:
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return ((array - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)


def read(infer: Infer, image: Image.Image, threshold: float = 0.3) -> Reading:
    # 1. Detection: sides rounded to multiples of 32.
    width, height = max(32, round(image.width / 32) * 32), max(32, round(image.height / 32) * 32)
    text_map = infer(DETECT, {"x": _normalize(image.resize((width, height)))})["sigmoid_0.tmp_0"]
    ys, xs = np.nonzero(text_map[0, 0] > threshold)
    if len(xs) == 0:
        raise ValueError("no text found")
    sx, sy = image.width / width, image.height / height
    margin = 6
    box = (max(0, int(xs.min() * sx) - margin), max(0, int(ys.min() * sy) - margin),
           min(image.width, int((xs.max() + 1) * sx) + margin), min(image.height, int((ys.max() + 1) * sy) + margin))
    # 2. Recognition of the crop, 48 pixels high.
    crop = image.crop(box)
    line = crop.resize((min(320, max(16, round(48 * crop.width / crop.height))), 48))
    scores = infer(RECOGNIZE, {"x": _normalize(line)})["softmax_11.tmp_0"]
    return Reading(box, text_map, scores)


def charset(model_file: pathlib.Path) -> list[str]:
    """The recognizer's characters, which the model file carries in its metadata (class 0 is the CTC blank)."""
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(model_file), load_external_data=False).metadata_props}
    return ["", *meta["character"].splitlines(), " "]


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
    reading = read(triton_infer(args.url), text_image("VOLGA 2026"))
    chars = charset(pathlib.Path(__file__).parent / "text-recognition.onnx")
    print(f"text at {reading.box}: {''.join(chars[i] for i in reading.indices())!r}")
