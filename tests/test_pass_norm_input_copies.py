"""NormInputCopies: the slice / reshape chain a norm reads (Qwen3's per-head q / k norms of the
QKV GEMM's output) is marked to fuse into the norm's kernel; other shapes are left alone."""

from __future__ import annotations

import tvm
from tvm import relax

from tests.relax_util import apply_pass, assert_same_numerics
from tvmfuse.passes.norm_input_copies import NormInputCopies

S, H, D = 8, 2, 16  # rows, heads normalised, head dim


def qk_norm_module(reader: str = "transpose", start: int = D, dtype: str = "float16",
                   width: int = 4 * D) -> tvm.IRModule:
    """``x (S, width) → x[:, start : start + H·D] → (1, S, H, D) → rms_norm over D → reader``,
    legalised and annotated as FuseOps sees it. ``reader``: "transpose" (the attention layout,
    injective), "add" (elementwise: fuses into the norm as it is), "shared" (the slice is also
    read by another kernel)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([S, width], dtype))
    w = relax.Var("w", relax.TensorType([D], dtype))
    op = relax.op
    with bb.function("main", [x, w]):
        with bb.dataflow():
            q = bb.emit(op.strided_slice(x, [1], [start], [start + H * D]))
            n = bb.emit(op.nn.rms_norm(bb.emit(op.reshape(q, (1, S, H, D))), w, axes=[-1]))
            if reader == "add":
                out = bb.emit(op.add(n, n))
            elif reader == "rope":  # Gemma-3: x·cos beside a rotate-half slice of the norm
                half = bb.emit(op.strided_slice(n, [3], [D // 2], [D]))
                out = bb.emit(op.add(op.multiply(n, n), op.concat([half, half], axis=3)))
            else:
                out = bb.emit(op.permute_dims(n, [0, 2, 1, 3]))
            if reader == "shared":
                out = bb.emit(op.add(op.reshape(out, (1, H, S * D)), op.reshape(q, (1, H, S * D))))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    return relax.transform.AnnotateTIROpPattern()(mod)


def _patterns(mod: tvm.IRModule) -> dict[str, int]:
    """Callee name → op_pattern of every call_tir in ``main``, in order."""
    out = {}
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir":
                callee = b.value.args[0]
                out[callee.name_hint] = int(mod[callee].attrs["op_pattern"])
    return out


def _fused(mod: tvm.IRModule) -> tvm.IRModule:
    return relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))


def test_slice_chain_fuses_into_the_norm():
    before = qk_norm_module()
    after = apply_pass(NormInputCopies(), before)
    # the copies are broadcast and the norm a reduction for FuseOps; the transpose keeps its mark
    assert _patterns(before) == {"strided_slice": 2, "reshape": 2, "rms_norm": 4, "transpose": 2}
    assert _patterns(after) == {"strided_slice": 1, "reshape": 1, "rms_norm": 3, "transpose": 2}
    calls = [str(b.value.args[0].name_hint) for b in _fused(after)["main"].body.blocks[0].bindings]
    assert calls == ["fused_strided_slice_reshape_rms_norm", "transpose"]
    assert len(_fused(before)["main"].body.blocks[0].bindings) == 3  # copy, norm, transpose
    assert_same_numerics(before, _fused(after), rtol=1e-3)


def test_left_alone_with_an_elementwise_reader():
    """An elementwise reader already fuses into the norm: a reduction would lose it."""
    before = qk_norm_module("add")
    tvm.ir.assert_structural_equal(apply_pass(NormInputCopies(), before), before)


def test_elementwise_beside_an_injective_reader():
    """RoPE after the norm (x·cos and a rotate-half slice): the multiply does not fuse into the
    norm either way, so the slice chain goes in."""
    before = qk_norm_module("rope")
    after = apply_pass(NormInputCopies(), before)
    patterns = _patterns(after)
    assert patterns["rms_norm"] == 3 and patterns["strided_slice"] == 1, patterns
    names = [b.value.args[0].name_hint for b in _fused(after)["main"].body.blocks[0].bindings]
    assert names[0] == "fused_strided_slice_reshape_rms_norm", names
    assert_same_numerics(before, _fused(after), rtol=1e-3)


def test_a_slice_read_elsewhere_stays_a_copy():
    """The chain stops at a link read by another kernel too: that slice keeps its mark (one copy
    kernel, read by both), the reshape after it still joins the norm."""
    before = qk_norm_module("shared")
    after = apply_pass(NormInputCopies(), before)
    patterns = _patterns(after)
    assert patterns["strided_slice"] == 2 and patterns["rms_norm"] == 3
    assert int(after["reshape"].attrs["op_pattern"]) == 1
    assert_same_numerics(before, _fused(after), rtol=1e-3)


def test_shared_primfunc_is_copied():
    """Where another call of the same PrimFunc is not re-marked, the marked call gets a copy."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([S, 4 * D], "float16"))
    w = relax.Var("w", relax.TensorType([D], "float16"))
    op = relax.op
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(op.reshape(op.strided_slice(x, [1], [0], [H * D]), (1, S, H, D)))
            b = bb.emit(op.reshape(op.strided_slice(x, [1], [H * D], [2 * H * D]), (1, S, H, D)))
            n = bb.emit(op.permute_dims(op.nn.rms_norm(a, w, axes=[-1]), [0, 2, 1, 3]))
            out = bb.emit_output(op.add(n, op.permute_dims(b, [0, 2, 1, 3])))
        bb.emit_func_output(out)
    before = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(bb.get()))
    after = apply_pass(NormInputCopies(), before)
    names = [g.name_hint for g in after.get_global_vars()]
    assert "reshape_to_norm" in names and "reshape" in names  # b's reshape keeps the injective one
    assert int(after["reshape"].attrs["op_pattern"]) == 2
    assert int(after["reshape_to_norm"].attrs["op_pattern"]) == 1
    assert_same_numerics(before, _fused(after), rtol=1e-3)
