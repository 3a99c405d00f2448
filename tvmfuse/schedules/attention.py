"""Attention kernels: the contract between the attention rewrite and the kernel generators.

The rewrite (``tvmfuse.passes.attention``) turns an attention subgraph into ``R.nn.attention``;
its legalisation calls :func:`attention_primfunc` with an :class:`AttentionSpec` read off the call,
and emits ``R.call_tir`` to the returned PrimFunc. Layout is TVM's ``R.nn.attention`` layout::

    q    (B, Sq,  Hq,  D)        k, v (B, Skv, Hkv, D)        Hq % Hkv == 0 (GQA / MQA)
    bias (B|1, Hq|1, Sq|1, Skv)  additive, optional (padding masks arrive as (B, 1, 1, Skv))
    out  (B, Sq,  Hq,  D)
    out[b, i, h] = Σ_j softmax_j(scale · q[b, i, h]·k[b, j, h // (Hq/Hkv)] + bias[..] + causal(i, j))
                   · v[b, j, h // (Hq/Hkv)]

``causal``: ``"none"``, ``"TopLeft"`` (key j visible to query i iff j ≤ i) or ``"BottomRight"``
(iff j ≤ i + Skv − Sq; the KV-cache alignment). Both are the same when Sq == Skv.

Fully masked rows: a query row whose every score is −inf (it sees no key: BottomRight with
Sq > Skv, or a −inf bias on every visible key) yields ``out = 0``, not NaN, in every
implementation (cpu, flash sm80 / sm90a, split-KV decode, the CUDA-core fallback and the
kernel-less decomposition of ``tvmfuse.passes.attention_lower``). That is what torch's
``_safe_softmax`` (``where(all(S == −inf), 0, softmax(S))``) computes, so the attention rewrite
drops that guard on the strength of this rule; a new kernel must keep it.

The returned PrimFunc takes its buffers in the order ``q, k, v, [bias,] out`` and is already
scheduled for ``target`` (attribute ``tirx.is_scheduled``, which dlight honours) where
``target`` is CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

CAUSAL_KINDS = ("none", "TopLeft", "BottomRight")


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (all shapes static)."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # q/k/v dtype: float16 | bfloat16 | float32
    scale: float
    causal: str = "none"  # one of CAUSAL_KINDS
    bias_shape: tuple[int, int, int, int] | None = None  # (B|1, Hq|1, Sq|1, Skv) or None
    bias_dtype: str | None = None
    out_dtype: str | None = None  # defaults to dtype

    def __post_init__(self) -> None:
        if self.causal not in CAUSAL_KINDS:
            raise ValueError(f"causal must be one of {CAUSAL_KINDS}, not {self.causal!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.q_heads // self.kv_heads

    @property
    def result_dtype(self) -> str:
        return self.out_dtype or self.dtype


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
        return _cuda_primfunc(spec, target).with_attr("tirx.is_scheduled", True)
    from .attention_cpu import attention_cpu_primfunc

    return attention_cpu_primfunc(spec)


def _cuda_primfunc(spec: AttentionSpec, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The CUDA kernel for ``spec``: see :func:`attention_primfunc`."""
    from .attention_generic_cuda import attention_generic_cuda_primfunc

    if spec.q_len == 1:
        from .flash_decode import flash_decode_primfunc

        try:
            return flash_decode_primfunc(spec, target)
        except ValueError as err:  # dtype / head dim the split-KV kernel does not take
            return attention_generic_cuda_primfunc(spec, str(err))
    from .flash_attention import flash_attention_primfunc
    from .flash_attention import unsupported as flash_unsupported

    reason = flash_unsupported(spec)
    if reason is not None:  # still one kernel without S in HBM, on CUDA cores
        return attention_generic_cuda_primfunc(spec, f"flash_attention: {reason}")
    if str(target.attrs.get("arch", "")) == "sm_90a":
        from .flash_attention_sm90 import flash_attention_sm90_primfunc, unsupported

        reason = unsupported(spec)
        if reason is None:
            return flash_attention_sm90_primfunc(spec, target)
        func = flash_attention_primfunc(spec, target)
        return func.with_attr("tvmfuse.fallback", f"flash_attention_sm90: {reason}")
    return flash_attention_primfunc(spec, target)
