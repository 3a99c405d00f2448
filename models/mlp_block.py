"""A pre-norm transformer MLP block.

    y = x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2

Shapes: ``x``: (batch, seq, hidden) → ``y``: (batch, seq, hidden); W1: (ffn, hidden),
W2: (hidden, ffn). GELU is the exact (erf) form.

``small()`` is the zero-argument factory used by ``tvmfuse compile models.mlp_block:small``.
"""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    """``y = x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build(
    batch: int = 2,
    seq: int = 16,
    hidden: int = 64,
    ffn: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised ``MLPBlock`` (``ffn`` defaults to 4·hidden) and a randn input."""
    torch.manual_seed(seed)
    module = MLPBlock(hidden, ffn if ffn is not None else 4 * hidden)
    with torch.no_grad():
        # LayerNorm's default affine params are 1 and 0; randomise them so they are tested too.
        module.norm.weight.normal_(1.0, 0.1)
        module.norm.bias.normal_(0.0, 0.1)
    module = module.to(dtype).eval()
    x = torch.randn(batch, seq, hidden, dtype=dtype)
    return module, (x,)


def small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The default-size block: x of shape (2, 16, 64), ffn 256."""
    return build()
