"""The embedded default model: a CTR-style ranking model built here, with no downloads.

26 hashed categorical features look up a shared 64-wide embedding table (250k rows, 64 MB), 13 dense
features join them, and a 1024-512-256-1 MLP with a sigmoid scores the click probability. Weights come
from a fixed seed, so every build is byte-identical and outputs can be compared across machines. About
73 MB of float32 weights: big enough that loading and warming up is a real cost, small enough for CI.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np

from volga_core import api

MODEL_ID = "ctr-default"
SPARSE_FIELDS = 26
DENSE_FEATURES = 13
EMBEDDING_ROWS = 250_000
EMBEDDING_DIM = 64
HIDDEN = (1024, 512, 256)
SEED = 20261129
# IR version 8 (opset 17's own): onnx releases newer than a node's onnxruntime write IR versions it refuses.
IR_VERSION = 8


def build_onnx(path: pathlib.Path, rows: int = EMBEDDING_ROWS, external_data: bool = False) -> pathlib.Path:
    """Write the model to `path` (skipped when an identical build is already there); with `external_data`, its
    weights go to `<path>.data` beside it (ONNX external data), which workers map rather than copy."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    stamp = path.with_suffix(".stamp")
    key = f"{rows}-{EMBEDDING_DIM}-{HIDDEN}-{SEED}-ir{IR_VERSION}" + ("-external" if external_data else "")
    if path.exists() and stamp.exists() and stamp.read_text() == key:
        return path
    rng = np.random.default_rng(SEED)
    width = SPARSE_FIELDS * EMBEDDING_DIM + DENSE_FEATURES
    inits = [
        numpy_helper.from_array((rng.standard_normal((rows, EMBEDDING_DIM)) * 0.05).astype(np.float32), "emb"),
        numpy_helper.from_array(np.array([rows], dtype=np.int64), "rows"),
        numpy_helper.from_array(np.array([-1, SPARSE_FIELDS * EMBEDDING_DIM], dtype=np.int64), "flat_shape"),
    ]
    nodes = [
        helper.make_node("Mod", ["sparse", "rows"], ["ids"]),
        helper.make_node("Gather", ["emb", "ids"], ["looked_up"]),
        helper.make_node("Reshape", ["looked_up", "flat_shape"], ["flat"]),
        helper.make_node("Concat", ["flat", "dense"], ["h0"], axis=1),
    ]
    sizes = (width, *HIDDEN, 1)
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        scale = np.sqrt(2.0 / n_in)
        inits.append(numpy_helper.from_array((rng.standard_normal((n_in, n_out)) * scale).astype(np.float32), f"w{i}"))
        inits.append(numpy_helper.from_array(np.zeros(n_out, dtype=np.float32) + 0.01, f"b{i}"))
        last = i == len(sizes) - 2
        nodes.append(helper.make_node("Gemm", [f"h{i}", f"w{i}", f"b{i}"], [f"z{i}" if last else f"g{i}"]))
        nodes.append(helper.make_node("Sigmoid" if last else "Relu", [f"z{i}" if last else f"g{i}"],
                                      ["probability" if last else f"h{i + 1}"]))
    graph = helper.make_graph(
        nodes, "ctr",
        [helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["batch", DENSE_FEATURES]),
         helper.make_tensor_value_info("sparse", TensorProto.INT64, ["batch", SPARSE_FIELDS])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["batch", 1])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="volga",
                              ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    if external_data:
        data = path.name + ".data"
        pathlib.Path(tmp.parent / data).unlink(missing_ok=True)
        onnx.save(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                  size_threshold=1024)
        (tmp.parent / data).chmod(0o644)  # onnx writes it for its owner only; workers run as another user
    else:
        onnx.save(model, tmp)
    tmp.rename(path)
    stamp.write_text(key)
    return path


def spec_document(model_path: pathlib.Path) -> dict[str, object]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": "ModelSpec",
        "metadata": {"name": MODEL_ID},
        "spec": {
            "modelId": MODEL_ID,
            "framework": "onnx",
            "source": f"file://{model_path}",
            "version": "1",
            "inputs": [{"name": "dense", "dtype": "FP32", "shape": [-1, DENSE_FEATURES]},
                       {"name": "sparse", "dtype": "INT64", "shape": [-1, SPARSE_FIELDS]}],
            "outputs": [{"name": "probability", "dtype": "FP32", "shape": [-1, 1]}],
            "targets": {"latencyMs": 10},
            "pool": {"hot": 0, "frozen": 1},
            "runtime": {"warmupIterations": 5, "resetRngOnRestore": True, "intraOpThreads": 1},
        },
    }


def default_cache() -> pathlib.Path:
    return pathlib.Path.home() / ".cache" / "volga" / "models"


def ensure(root: pathlib.Path | None = None) -> api.ModelSpec:
    """Build (once) the default model and return its ModelSpec."""
    path = build_onnx((root or default_cache()) / MODEL_ID / "model.onnx")
    return api.parse_model_spec(spec_document(path), "embedded default")
