"""A PyTorch model served from source: Volga runs this file and calls `build_model()` (no arguments), then
`.eval()`. The module is called with the spec's inputs as positional tensors, in the spec's order; it may return
one tensor, a tuple or list (in the spec's output order) or a dict keyed by output name.

This one is a small digit-sized classifier with fixed random weights (seeded); a real one would load its trained
weights here, e.g. `model.load_state_dict(torch.load(pathlib.Path(__file__).parent / "weights.pt"))` -
`__file__` is this file's path.
"""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.features(image).flatten(1))
        return {"logits": logits, "probabilities": logits.softmax(dim=1)}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()
