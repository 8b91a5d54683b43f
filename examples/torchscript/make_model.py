"""Build the TorchScript file this example serves: a scripted module saved with torch.jit.save.

    python examples/torchscript/make_model.py        # writes examples/torchscript/model.pt

A TorchScript file carries the code and the weights, so the node needs only torch to load it (torch.jit.load).
"""

from __future__ import annotations

import pathlib
import sys

import torch
from torch import nn


class Scorer(nn.Module):
    """Scores a sequence of feature vectors: a GRU over time, then a linear layer on its last state."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.out = nn.Linear(32, 3)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        _, last = self.rnn(sequence)
        return self.out(last[-1])


def build(path: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(Scorer().eval()), str(path))
    return path


if __name__ == "__main__":
    print(build(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "model.pt"))
