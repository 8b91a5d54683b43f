"""A KServe model server that knows nothing of Volga: a `kserve.Model` with custom Python pre- and post-processing
around a small numpy predictor, served by KServe's own `ModelServer` (REST v1 and v2).

Run: python -m volga_bench.servers.kserve_scorer --http_port PORT --enable_grpc false --model_name scorer"""

from __future__ import annotations

import argparse
from typing import Any

import kserve
import numpy as np
from kserve import model_server


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
        # Custom pre-processing: each row centred and scaled to unit length.
        rows = np.asarray(payload["instances"], dtype=np.float64)
        rows = rows - rows.mean(axis=1, keepdims=True)
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)

    def predict(self, payload: Any, headers: Any = None) -> Any:
        assert self.weights is not None
        return payload @ self.weights

    def postprocess(self, result: Any, headers: Any = None, response_headers: Any = None) -> Any:
        # Custom post-processing: softmax, the label and its rounded scores.
        e = np.exp(result - result.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        return {"predictions": [{"label": int(row.argmax()), "scores": [round(float(v), 6) for v in row]} for row in p]}


if __name__ == "__main__":
    args, _ = argparse.ArgumentParser(parents=[model_server.parser]).parse_known_args()
    kserve.ModelServer().start([Scorer(args.model_name)])
