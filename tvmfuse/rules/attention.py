"""Attention kernel choice: which generator computes an :class:`.attention_spec.AttentionSpec`.

``R.nn.attention``'s legalisation (``tvmfuse.passes.attention_lower``) calls
:func:`attention_primfunc`; the layout, semantics and fully-masked-row rule every kernel keeps are
in :mod:`.attention_spec`. The returned PrimFunc takes its buffers in the order
``q, k, v, [bias,] out`` and is already scheduled for ``target`` (attribute ``tirx.is_scheduled``,
which dlight honours) where ``target`` is CUDA.
"""

from __future__ import annotations

import dataclasses

import tvm

from ..attrs import FALLBACK_ATTR, FLOPS_ATTR
from ..device_props import device_properties
from ..kernels.attention.cpu import attention_cpu_primfunc
from ..kernels.attention.flash_decode import check as decode_check
from ..kernels.attention.flash_decode import flash_decode_primfunc
from ..kernels.attention.flash_sm80 import check as flash_check
from ..kernels.attention.flash_sm80 import flash_attention_primfunc
from ..kernels.attention.flash_sm90 import Sm90FlashConfig, default_config, flash_attention_sm90_primfunc
from ..kernels.attention.flash_sm90 import check as sm90_check
from ..kernels.attention.generic_cuda import attention_generic_cuda_primfunc
from ..kernels.attention.spec import CAUSAL_KINDS, AttentionSpec
from ..options import current_options

__all__ = ["CAUSAL_KINDS", "AttentionSpec", "attention_primfunc"]


def attention_primfunc(spec: AttentionSpec, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """One PrimFunc computing ``spec`` without materialising the Sq×Skv score matrix in HBM.

    CUDA: the flash kernel (prefill) or the split-KV decode kernel (Sq == 1), and for specs
    neither takes (fp32, other head dims) a one-thread-per-row CUDA-core kernel; on sm_90a the
    TMA + wgmma prefill kernel where it covers the spec, else the sm80-style one with the reason
    in its ``tvmfuse.fallback`` attribute;
    CPU: a row-at-a-time online-softmax loop (numerics reference for the cpu target).
    """
    if target.kind.name == "cuda":
        # dlight (0.27) skips only ``tirx.is_scheduled``; some kernels set the older ``tir.`` name
        func = _cuda_primfunc(spec, target).with_attr("tirx.is_scheduled", True)
    else:
        func = attention_cpu_primfunc(spec)
    # the report's FLOPs: TVM's estimate miscounts these loops (5377 GFLOP for a 0.03 GFLOP call)
    return func.with_attr(FLOPS_ATTR, tvm.tirx.IntImm("int64", spec.flops))


def _cuda_primfunc(spec: AttentionSpec, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The CUDA kernel for ``spec``: see :func:`attention_primfunc`."""
    # each generator's check() says "not mine" with the reason; the next kernel then takes the spec
    if spec.q_len == 1:
        reason = decode_check(spec)
        if reason is None:
            return flash_decode_primfunc(spec, target)
        return attention_generic_cuda_primfunc(spec, f"flash decode: {reason}")
    reason = flash_check(spec)
    if reason is not None:  # still one kernel without S in HBM, on CUDA cores
        return attention_generic_cuda_primfunc(spec, f"flash_attention: {reason}")
    if str(target.attrs.get("arch", "")) == "sm_90a":
        cfg = sm90_config(spec, target)
        reason = sm90_check(spec, cfg)
        if reason is None and spec.bias_shape is not None and not current_options().sm90_attention_bias:
            reason = "an additive bias, with Options.sm90_attention_bias off"
        if reason is None:
            return flash_attention_sm90_primfunc(spec, target, cfg)
        func = flash_attention_primfunc(spec, target)
        return func.with_attr(FALLBACK_ATTR, f"flash_attention_sm90: {reason}")
    return flash_attention_primfunc(spec, target)


PERSISTENT_MAX_KV_TILES = 16  # measured: persistent CTAs won up to 16 KV tiles a query tile


def sm90_config(spec: AttentionSpec, target: tvm.target.Target) -> Sm90FlashConfig:
    """The sm_90a kernel's tile, with one persistent CTA per SM of the target's device where
    ``Options.sm90_attention_persistent`` says so; None (default): where a query tile visits at
    most :data:`PERSISTENT_MAX_KV_TILES` KV tiles (the measurements are in the option's note)."""
    cfg = default_config(spec)
    want = current_options().sm90_attention_persistent
    if want is None:
        want = max_kv_tiles(spec, cfg.block_m, cfg.block_n) <= PERSISTENT_MAX_KV_TILES
    if want:
        cfg = dataclasses.replace(cfg, persistent_ctas=device_properties(target).sms)
    return cfg


def max_kv_tiles(spec: AttentionSpec, block_m: int, block_n: int) -> int:
    """The most KV tiles one query tile of ``block_m`` rows visits: all ``ceil(Skv / BN)``, or
    with a window of w keys at most ``ceil((w + BM) / BN) + 1`` (the band's span)."""
    tiles = -(-spec.kv_len // block_n)
    if spec.window is not None:
        tiles = min(tiles, -(-(spec.window + block_m) // block_n) + 1)
    return tiles
