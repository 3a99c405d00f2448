"""Attention as users write it, through ``tvmfuse.compile``: the patterns issue's two forms.

``handwritten``: an fp16 module on (B, H, S, D) tensors doing
    s = (q @ kᵀ) · D^-0.5;  s = s.masked_fill(mask, -inf);  p = softmax(s.float(), -1).to(fp16);  o = p @ v
with ``mask`` a non-persistent bool buffer ``ones(S, S).triu(1)``;
``sdpa_bhsd``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, D) inputs.
cuda: B4·S2048·H16·D128 fp16; cpu smoke: B1·S64·H2·D32. FLOPs = 2·B·H·S²·D (causal half of 4·…).
Baseline: ``sdpa_ms`` = eager ``F.scaled_dot_product_attention(..., is_causal=True)`` on the same
tensors (the flash backend on the H200); torch_eager_ms is the module itself.

``sliding_window``: the hand-written form with a causal band of ``w`` keys (bool buffer
``~ones(S, S).tril().triu(1 − w)``, Mistral's window), compiled to ``window_size=w``.
cuda: B1·S8192·H16·D128 fp16, w = 1024; cpu smoke: B1·S64·H2·D32, w = 16.
FLOPs = 4·B·H·D·(visible pairs, w·S − w(w−1)/2). Baselines: ``sdpa_ms`` = eager SDPA with the
equivalent bool ``attn_mask``; for context ``sdpa_causal_ms`` (the full causal SDPA, is_causal) and,
on cuda, ``flex_ms`` (torch.compile'd ``flex_attention`` with the sliding-window block mask).
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (4, 16, 2048, 128), "cpu": (1, 2, 64, 32)}  # (B, H, S, D)
WINDOW_SIZES = {"cuda": (1, 16, 8192, 128, 1024), "cpu": (1, 2, 64, 32, 16)}  # (B, H, S, D, w)


class HandWritten(nn.Module):
    """Causal attention with a bool-buffer mask, the way the issue's user wrote it."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(self.mask, float("-inf"))
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return p @ v


class SdpaBHSD(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, D) tensors."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SlidingWindow(nn.Module):
    """The hand-written form with a causal band: query i sees keys i − w < j ≤ i."""

    def __init__(self, seq: int, window: int) -> None:
        super().__init__()
        keep = torch.ones(seq, seq, dtype=torch.bool).tril().triu(1 - window)
        self.register_buffer("mask", ~keep, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(self.mask, float("-inf"))
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return p @ v


def _flex_window(seq: int, window: int):
    """torch.compile'd flex_attention with the band as a block mask (built at the first call)."""
    state: dict[str, Any] = {}

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not state:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def band(b, h, qi, kj):
                return (kj <= qi) & (qi - kj < window)

            state["mask"] = create_block_mask(band, None, None, seq, seq, device=q.device)
            state["fn"] = torch.compile(flex_attention)
        return state["fn"](q, k, v, block_mask=state["mask"])

    return call


def window_workload(args: argparse.Namespace) -> common.Workload:
    """The sliding-window form at the shape of ``args.device``."""
    b, h, s, d, w = WINDOW_SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    inputs = common.random_inputs([(b, h, s, d)] * 3, dtype)
    module = SlidingWindow(s, w).to(dtype).eval()
    keep: dict[torch.device, torch.Tensor] = {}  # the bool mask, moved to the device once

    def sdpa_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = keep.setdefault(q.device, ~module.mask.to(q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    extra = {"sdpa_ms": sdpa_mask,
             "sdpa_causal_ms": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if args.device == "cuda":
        extra["flex_ms"] = _flex_window(s, w)
    pairs = w * s - w * (w - 1) // 2
    return common.Workload(name="attn_sliding_window", module=module, inputs=inputs,
                           shape=f"B={b} H={h} S={s} D={d} window={w} BHSD", dtype=args.dtype,
                           flops=4.0 * b * h * d * pairs, extra=extra)


def workloads(args: argparse.Namespace) -> list[common.Workload]:
    """The forms at the shape of ``args.device``."""
    b, h, s, d = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    inputs = common.random_inputs([(b, h, s, d)] * 3, dtype)
    sdpa = {"sdpa_ms": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    shape = f"B={b} H={h} S={s} D={d} causal BHSD"
    flops = 2.0 * b * h * s * s * d
    return [*(common.Workload(name=f"attn_{name}", module=module.to(dtype).eval(), inputs=inputs,
                              shape=shape, dtype=args.dtype, flops=flops, extra=sdpa)
              for name, module in (("handwritten", HandWritten(s)), ("sdpa_bhsd", SdpaBHSD()))),
            window_workload(args)]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark every form; one row each."""
    rows = []
    for wl in workloads(args):
        rows.append(common.bench(wl, args))
    return rows


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
