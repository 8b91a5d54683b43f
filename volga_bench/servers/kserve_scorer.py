"""A KServe model server that knows nothing of Volga: a `kserve.Model` with custom Python pre- and post-processing
around a small numpy predictor, served by KServe's own `ModelServer`: REST v1 (`instances` in, `predictions` out)
and the Open Inference Protocol (v2) over REST and gRPC (an input `rows`, FP32 [N, 16], in; `probabilities`, FP64
[N, 4], and `label`, INT64 [N], out), the same pre/post-processing on both.

Run: python -m volga_bench.servers.kserve_scorer --http_port PORT --grpc_port PORT2 --model_name scorer (or
--enable_grpc false)"""

from __future__ import annotations

import argparse
from typing import Any

import kserve
import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, model_server


class Scorer(kserve.Model):  # type: ignore[misc]  # kserve ships no types
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.weights: np.ndarray | None = None
        self.load()

    def load(self) -> bool:
        self.weights = np.random.default_rng(3).standard_normal((16, 4))
        self.ready = True
        return self.ready

    def preprocess(self, payload: Any, headers: Any = None) -> Any:
        # Custom pre-processing: each row centred and scaled to unit length. An OIP request keeps its id beside.
        v2 = isinstance(payload, InferRequest)
        rows = np.asarray(payload.inputs[0].as_numpy() if v2 else payload["instances"], dtype=np.float64)
        rows = rows - rows.mean(axis=1, keepdims=True)
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)
        return (rows, payload.id or "") if v2 else rows

    def predict(self, payload: Any, headers: Any = None) -> Any:
        assert self.weights is not None
        if isinstance(payload, tuple):
            return payload[0] @ self.weights, payload[1]
        return payload @ self.weights

    def postprocess(self, result: Any, headers: Any = None, response_headers: Any = None) -> Any:
        # Custom post-processing: softmax, the label and its rounded scores.
        scores, request_id = result if isinstance(result, tuple) else (result, None)
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        if request_id is not None:
            labels = p.argmax(axis=1).astype(np.int64)
            return InferResponse(request_id, self.name, [
                InferOutput("probabilities", list(p.shape), "FP64", np.round(p, 6)),
                InferOutput("label", list(labels.shape), "INT64", labels)])
        return {"predictions": [{"label": int(row.argmax()), "scores": [round(float(v), 6) for v in row]} for row in p]}


if __name__ == "__main__":
    args, _ = argparse.ArgumentParser(parents=[model_server.parser]).parse_known_args()
    kserve.ModelServer().start([Scorer(args.model_name)])
