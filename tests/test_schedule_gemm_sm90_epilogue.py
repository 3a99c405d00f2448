"""sm_90a GEMM epilogue in fp32 (``hopper/opmath.py``): no half-precision ops, one rounding.

The analysed epilogue of a fused fp16 GEMM (GELU, SiLU·gate) is rewritten to an fp32 chain on the
accumulator; these tests walk the rewritten expression, evaluate it on the CPU (llvm) against a
float64 reference, and check the generated sm_90a kernel compiles with nvcc.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import tirx

import tvmfuse
from tests.test_schedule_gemm_sm90 import LinearAct, SwiGLU, _inputs, _lowered_funcs, needs_cuobjdump
from tvmfuse.build.inspect import cuda_images, fatbin_sass
from tvmfuse.kernels.gemm.epilogue import analyze, expr_value
from tvmfuse.kernels.gemm.opmath import opmath, to_fp32
from tvmfuse.rules.gemm_sm90 import NAME, build_kernel


def _dtypes(e) -> list[str]:
    """dtype of every computed node of a primitive expression, root first (loads: "load")."""
    if isinstance(e, tvm.ir.TensorLoad):
        return ["load"]
    out = [str(e.ty.dtype)]
    for name in ("a", "b", "value", "condition", "true_value", "false_value"):
        child = getattr(e, name, None)
        if isinstance(child, tvm.ir.expr.Expr):
            out += _dtypes(child)
    for child in list(getattr(e, "args", None) or []) + list(getattr(e, "indices", None) or []):
        out += _dtypes(child)
    return out


def _fused(module, inputs):
    """The s_tir fused GEMM PrimFunc(s) before the sm90 rule replaces them."""
    from tvmfuse.frontend import import_model
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target

    seen = {}
    lower(import_model(module, inputs).mod, get_target("sm90"),
          on_stage=lambda name, mod: seen.setdefault(name, mod))
    return [f for gv, f in seen["reshape_to_view"].functions_items()
            if isinstance(f, tirx.PrimFunc) and "matmul" in gv.name_hint]


def _gelu_case():
    return _fused(LinearAct("gelu"), _inputs(128, 256, 64, torch.float16))[0]


def test_gelu_epilogue_is_fp32_with_one_rounding():
    """Before: fp16 ops with casts around erf; after: every node fp32 but the final cast."""
    g = analyze(_gelu_case())
    assert "float16" in _dtypes(g.expr)[1:]  # the graph's chain: intermediate fp16 values
    e = opmath(g.expr, g.out_dtype)
    assert isinstance(e, tirx.Cast) and str(e.ty.dtype) == "float16"
    inner = _dtypes(e.value)
    assert set(inner) <= {"float32", "int32", "int64", "load"}, inner
    assert "T.erf" in str(e)


def test_swiglu_gate_epilogue_is_fp32():
    x, w, _ = _inputs(128, 256, 64, torch.float16)
    funcs = _fused(SwiGLU(), (x, w, w.flip(0).contiguous()))
    exprs = []
    for f in funcs:
        g = analyze(f)
        exprs.append(opmath(g.expr, g.out_dtype))
    gated = [e for e in exprs if "sigmoid" in str(e)]
    assert gated, [str(e) for e in exprs]
    for e in gated:
        assert set(_dtypes(e.value)) <= {"float32", "int32", "int64", "load"}, str(e)


def test_to_fp32_leaves_int_and_bool_alone():
    """Integer index math and comparisons stay; casts from int to half become casts to fp32."""
    i = tirx.Var("i", "int32")
    h = tirx.Cast("float16", i * 2)
    e = tirx.Select(i < 3, h + tirx.FloatImm("float16", 1.5), tirx.FloatImm("float16", 0.0))
    out = to_fp32(e)
    assert str(out.ty.dtype) == "float32"
    assert str(out.condition.ty.dtype) == "bool" and str(out.condition.a.ty.dtype) == "int32"
    assert isinstance(out.true_value.a, tirx.Cast) and str(out.true_value.a.value.ty.dtype) == "int32"
    index = i * 2
    assert opmath(index, "int32").same_as(index)


def _eval_epilogue(func, g, expr, acc: np.ndarray, params: dict[int, np.ndarray]) -> np.ndarray:
    """``out[i, j] = expr(acc[i, j], params)`` (``expr`` of ``g = analyze(func)``), rebuilt by
    ``expr_value`` into a kernel built for llvm."""
    from tvm.script import tirx as T

    m, n = acc.shape
    acc_buf = tirx.decl_buffer((m, n), "float32", name="ACC")
    new = {k: tirx.decl_buffer(tuple(int(d) for d in func.params[k].shape),
                               str(func.params[k].dtype), name=f"p{k}") for k in sorted(params)}
    out_buf = tirx.decl_buffer((m, n), g.out_dtype, name="OUT")
    buffers = [(func.params[k], b) for k, b in new.items()]

    @T.prim_func(check_well_formed=False)
    def body():
        for i, j in T.grid(m, n):
            out_buf[i, j] = expr_value(expr, [(g.acc, acc_buf[i, j]), (g.dims[0], i),
                                              (g.dims[1], j)], buffers)

    main = tirx.PrimFunc([acc_buf, *new.values(), out_buf], body.body).with_attr(
        "global_symbol", "main")
    lib = tvm.compile(main, target="llvm")
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((m, n), g.out_dtype), dev)
    lib(tvm.runtime.tensor(acc, dev), *(tvm.runtime.tensor(params[k], dev) for k in sorted(params)),
        out)
    return out.numpy()


def test_gelu_fp32_epilogue_is_more_accurate_on_cpu():
    """On random accumulators the fp32 chain is within one fp16 ulp of float64 GELU and closer to
    it on average than the graph's fp16 chain."""
    func = _gelu_case()
    g = analyze(func)
    rng = np.random.default_rng(0)
    acc = (rng.standard_normal((128, 256)) * 3).astype("float32")
    bias_pos = next(i for i in range(len(func.params)) if i not in (g.a, g.b, g.out))
    bias = rng.standard_normal(int(func.params[bias_pos].shape[0])).astype(str(func.params[bias_pos].dtype))
    ref = torch.nn.functional.gelu(torch.from_numpy(acc.astype("float64") + bias.astype("float64"))).numpy()
    new = _eval_epilogue(func, g, opmath(g.expr, g.out_dtype), acc, {bias_pos: bias}).astype("float64")
    old = _eval_epilogue(func, g, g.expr, acc, {bias_pos: bias}).astype("float64")
    ulp = np.abs(np.spacing(ref.astype("float16")).astype("float64"))
    # within one fp16 ulp, up to fp32's cancellation in 1 + erf(x) for x << 0 (|GELU| < 1e-5)
    assert np.all(np.abs(new - ref) <= np.maximum(ulp, 1e-6))
    err_new, err_old = np.abs(new - ref).mean(), np.abs(old - ref).mean()
    assert err_new < err_old, (err_new, err_old)


@pytest.mark.parametrize("module", ["gelu", "swiglu"])
def test_sm90_kernel_store_has_no_half_math(module):
    """The generated kernel's epilogue store converts to fp16 once: no fp16 arithmetic in it."""
    if module == "gelu":
        funcs = _lowered_funcs(LinearAct("gelu"), _inputs(128, 256, 64, torch.float16))
    else:
        x, w, _ = _inputs(128, 256, 64, torch.float16)
        funcs = _lowered_funcs(SwiGLU(), (x, w, w.flip(0).contiguous()))
    kernels = [f for f in funcs.values() if f.attrs.get("tvmfuse.rule") == NAME]
    assert kernels
    for f in kernels:
        stores = [ln for ln in f.script().splitlines() if ("pair[" in ln or "qv[" in ln)
                  and "] = " in ln and "T.Ramp" not in ln]  # column pairs / quad slots
        assert stores
        for ln in stores:
            rhs = ln.split("] = ", 1)[1]
            assert rhs.count('"float16"') <= 1 and "T.float16(" not in rhs, ln


def test_build_kernel_uses_opmath():
    """build_kernel prints the fp32 epilogue (the erf argument is not a half value)."""
    kernel = build_kernel(_gelu_case())
    assert 'T.Cast("float32", T.Cast("float16"' not in kernel.script()


def test_fast_erf_constants_within_bound():
    """The A&S 7.1.26 constants fast_math16 uses give |erf error| ≤ 1.5e-7 (float64 evaluation)."""
    from math import erf

    from tvmfuse.kernels.gemm.opmath import _AS_A, _AS_P

    x = np.linspace(-6, 6, 20001)
    t = 1 / (1 + _AS_P * np.abs(x))
    poly = sum(a * t ** (i + 1) for i, a in enumerate(_AS_A))
    approx = np.sign(x) * (1 - poly * np.exp(-x * x))
    assert np.max(np.abs(approx - np.vectorize(erf)(x))) <= 1.5e-7


@needs_cuobjdump
def test_fast_math16_replaces_erf(tmp_path):
    """With ``GemmConfig.fast_math16`` (the default) the 16-bit GELU epilogue calls __expf /
    __fdividef instead of erf; the library builds with nvcc to HGMMA + MUFU.EX2. Switched off, erf
    comes back."""
    from tvmfuse.kernels.gemm.opmath import fast_math16
    from tvmfuse.kernels.gemm.sm90 import GemmConfig

    g = analyze(_gelu_case())
    e = fast_math16(opmath(g.expr, g.out_dtype))
    assert "erf" not in str(e) and "__expf" in str(e) and "__fdividef" in str(e)
    assert GemmConfig().fast_math16
    text = build_kernel(_gelu_case()).script()
    assert "T.erf" not in text and "__expf" in text
    assert "T.erf" in build_kernel(_gelu_case(), GemmConfig(fast_math16=False)).script()
    inputs = _inputs(128, 256, 64, torch.float16)
    path = tvmfuse.compile(LinearAct("gelu"), inputs, target="sm90").export(tmp_path / "m.so")
    (_, code), = cuda_images(path)
    sass = fatbin_sass(code)["sm_90a"]
    assert "HGMMA" in sass and "MUFU.EX2" in sass
