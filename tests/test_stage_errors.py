"""A pipeline stage that fails reaches the user as a CompileError naming the stage, the Relax
function, the binding and the op, with TVM's text only as the detail (issue 13, tvmfuse/locate.py);
the CLI prints it as one ``error: ...`` message with exit code 1 and no traceback.
"""

from __future__ import annotations

import pytest
import torch
import tvm
from click.testing import CliRunner
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmfuse import pipeline
from tvmfuse.cli import main
from tvmfuse.errors import CompileError
from tvmfuse.pipeline import _Stages


@I.ir_module
class HalfIntoTir:
    """ToMixedPrecision (TVM 0.27) fails on ``s``: ``r`` becomes fp16 and it tries to cast the
    PrimFunc argument of the call_tir back ("Expected TensorType, but got R.Callable")."""

    @T.prim_func(private=True, s_tir=True)
    def row_sum(x: T.Buffer((T.int64(16), T.int64(64)), "float32"),
                s: T.Buffer((T.int64(16), T.int64(1)), "float32")):
        for i, k in T.grid(T.int64(16), T.int64(64)):
            with T.sblock("s"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    s[vi, T.int64(0)] = T.float32(0)
                s[vi, T.int64(0)] = s[vi, T.int64(0)] + x[vi, vk]

    @R.function
    def main(x: R.Tensor((16, 64), "float32"), w: R.Tensor((64, 64), "float32")
             ) -> R.Tensor((16, 64), "float32"):
        cls = HalfIntoTir
        with R.dataflow():
            h = R.matmul(x, w)
            r = R.add(h, h)
            s = R.call_tir(cls.row_sum, (r,), out_ty=R.Tensor((16, 1), "float32"))
            y = R.multiply(r, s)
            R.output(y)
        return y


def _fail_at(op: str, message: str = "Check failed: (ok) is false: cannot handle this"):
    """A module pass that raises (as TVM's C++ checks do, no binding named) at a call of ``op``."""

    @tvm.transform.module_pass(opt_level=0, name="tests.FailAt")
    def fail(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                for block in func.body.blocks:
                    for b in block.bindings:
                        if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == op:
                            raise tvm.error.InternalError(message)
        return mod

    return fail


def test_tvm_pass_failure_names_function_binding_op():
    before = HalfIntoTir.script()
    with pytest.raises(CompileError) as info:
        _Stages()("to_mixed_precision", relax.transform.ToMixedPrecision(out_dtype="float32"),
                  HalfIntoTir)
    err = info.value
    assert (err.stage, err.function, err.binding, err.op, err.index) == (
        "to_mixed_precision", "main", "s", "relax.call_tir(row_sum)", 3)
    text = str(err)
    assert text.startswith("stage 'to_mixed_precision' failed in function 'main' at binding 's' "
                           "(op relax.call_tir(row_sum), binding #3):"), text
    assert "s = R.call_tir(row_sum, (r,)" in text
    assert "detail: Check failed: (tensor) is false: Expected TensorType, but got R.Callable" in text
    assert HalfIntoTir.script() == before  # localising reran the stage on copies only


def test_python_pass_failure_names_the_binding():
    with pytest.raises(CompileError) as info:
        _Stages()("broken", _fail_at("relax.multiply"), HalfIntoTir)
    err = info.value
    assert (err.function, err.binding, err.op, err.index) == ("main", "y", "relax.multiply", 4)
    assert err.detail == "Check failed: (ok) is false: cannot handle this"


def test_unlocalisable_failure_still_names_the_stage():
    @tvm.transform.module_pass(opt_level=0, name="tests.Always")
    def always(mod, _ctx):
        raise ValueError("module-level problem")

    with pytest.raises(CompileError) as info:
        _Stages()("always", always, HalfIntoTir)
    assert info.value.binding is None
    assert str(info.value) == ("stage 'always' failed (not localised to a binding):\n"
                               "  detail: module-level problem")


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2


def test_cli_prints_stage_error_without_traceback(tmp_path, monkeypatch):
    """A stage of the real pipeline fails on a real model: one ``error:`` message, exit code 1."""
    path = tmp_path / "small.pt2"
    torch.export.save(torch.export.export(Small().eval(), (torch.randn(2, 8),)), path)
    monkeypatch.setattr(pipeline, "SimplifyNoOps", lambda: _fail_at("relax.tanh"))
    result = CliRunner().invoke(main, ["compile", str(path), "--target", "cpu",
                                       "-o", str(tmp_path / "small.so")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    error = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(error) == 1, result.output
    first = lines[error[0]]
    assert first.startswith("error: stage 'simplify_noops' failed in function 'main' at binding "), first
    assert "(op relax.tanh, binding #" in first
    assert "detail: Check failed: (ok) is false: cannot handle this" in result.output
    assert "Traceback" not in result.output


def test_kernel_stage_failure_names_the_calling_binding():
    """A stage that works on PrimFuncs (a schedule rule) fails on one kernel: the binding that
    calls it is named."""

    @tvm.transform.module_pass(opt_level=0, name="tests.FailOnKernel")
    def fail(mod, _ctx):
        if any(gv.name_hint == "row_sum" for gv in mod.get_global_vars()):
            raise RuntimeError("cannot schedule row_sum")
        return mod

    with pytest.raises(CompileError) as info:
        _Stages()("schedule", fail, HalfIntoTir)
    err = info.value
    assert (err.function, err.binding, err.op) == ("main", "s", "relax.call_tir(row_sum)")
