"""The peer `volga bench peers` compares the gateway with: KServe's Python ModelServer serving an ONNX model.

A small `kserve.Model` runs the model with onnxruntime under the same session settings as Volga's ONNX worker
(`volga_agent/worker/backends.py`: the given intra-op threads, no spinning), takes Open Inference Protocol v2
inputs and answers OIP v2 outputs, over REST and gRPC as KServe serves them. It is what a KServe user writes for
a model without a prebuilt runtime.

Run as a script, `python kserve_onnx.py --model_path M --model_name N --intra_op_threads 1 --grpc_port P ...`,
by any interpreter that has kserve, onnxruntime and numpy: Volga's own (the `peers` extra), or another virtual
environment's Python given to the bench (a KServe release of the user's choice). For that reason it imports nothing
of Volga.
"""

from __future__ import annotations

import argparse
import sys

import kserve
import numpy as np
import onnxruntime as ort
from kserve import model_server

# Open Inference Protocol datatypes of the numpy dtypes an ONNX model takes or gives.
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.float16): "FP16",
             np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.int16): "INT16",
             np.dtype(np.int8): "INT8", np.dtype(np.uint8): "UINT8", np.dtype(np.bool_): "BOOL"}


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    """The session settings of Volga's ONNX worker (`volga_agent/worker/backends.py`)."""
    options = ort.SessionOptions()
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OnnxModel(kserve.Model):  # type: ignore[misc]
    def __init__(self, name: str, path: str, intra_op_threads: int) -> None:
        super().__init__(name)
        self.path = path
        self.intra_op_threads = intra_op_threads
        self.session: ort.InferenceSession | None = None
        self.output_names: list[str] = []

    def load(self) -> bool:
        self.session = ort.InferenceSession(self.path, session_options(self.intra_op_threads),
                                            providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.ready = True
        return True

    def predict(self, payload: kserve.InferRequest, headers: dict[str, str] | None = None,
                response_headers: dict[str, str] | None = None) -> kserve.InferResponse:
        assert self.session is not None
        inputs = {i.name: i.as_numpy() for i in payload.inputs}
        results = self.session.run(self.output_names, inputs)
        outputs = []
        for name, array in zip(self.output_names, results, strict=True):
            out = kserve.InferOutput(name=name, shape=list(array.shape), datatype=DATATYPES[array.dtype])
            out.set_data_from_numpy(array, binary_data=True)
            outputs.append(out)
        return kserve.InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=outputs)


def main(argv: list[str] | None = None) -> int:
    # KServe reads its own options (ports, workers, logging) from the command line when imported; these are ours.
    parser = argparse.ArgumentParser(parents=[model_server.parser], add_help=False)
    parser.add_argument("--model_path", required=True)
    parser.add_argument("--intra_op_threads", type=int, default=1)
    args, _ = parser.parse_known_args(argv)
    model = OnnxModel(args.model_name, args.model_path, args.intra_op_threads)
    model.load()
    kserve.ModelServer().start([model])
    return 0


if __name__ == "__main__":
    sys.exit(main())
