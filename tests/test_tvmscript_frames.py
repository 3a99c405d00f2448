"""``tvmscript_frames``: the light ``inspect.stack`` gives TVMScript the frames the stdlib gives,
and kernels parse to the same functions with it."""

from __future__ import annotations

import inspect
import sys

import pytest
import tvm_ffi

from tvmfuse import tvmscript_frames
from tvmfuse.kernels.gemm.sm90 import GemmConfig, GemmProblem, standalone


def _fields(infos) -> list[tuple]:
    return [(i.frame, i.filename, i.lineno, i.function, i.code_context, i.index) for i in infos]


def _nested(depth: int, probe):
    return probe() if depth == 0 else _nested(depth - 1, probe)


@pytest.mark.parametrize("context", [0, 1])
def test_stack_matches_inspect(context):
    """Same frames, files, lines, functions and current source line, caller first."""
    got, want = _nested(3, lambda: (tvmscript_frames.stack(context), inspect.stack(context)))
    assert _fields(got)[1:] == _fields(want)[1:]  # [0]: the lambda, one line, two call sites
    assert got[0].function == want[0].function == "<lambda>"
    assert [i.function for i in got[1:5]] == ["_nested"] * 4
    assert got[1].code_context == ["    return probe() if depth == 0 else _nested(depth - 1, probe)\n"] \
        if context == 1 else got[1].code_context is None


def test_getouterframes_matches_inspect():
    frame = sys._getframe()
    assert _fields(tvmscript_frames.getouterframes(frame)) == _fields(inspect.getouterframes(frame))


def _tvm_users():
    return [sys.modules[name] for name in tvmscript_frames._USERS]


def test_kernels_parse_to_the_same_functions(monkeypatch):
    """An sm_90a GEMM (TVMScript with macros and closures), parsed with the stdlib frames and with
    the light ones, is one structure."""
    tvmscript_frames.install()
    problem = GemmProblem(1000, 512, 320, "float16", "float16", "nt")
    cfg = GemmConfig(bn=128, stages=6, cluster_m=2)
    fast = standalone(problem, cfg)
    for module in _tvm_users():
        monkeypatch.setattr(module, "inspect", inspect)
    slow = standalone(problem, cfg)
    assert tvm_ffi.structural_equal(fast, slow)


def test_install_is_idempotent_and_targets_tvm_only():
    tvmscript_frames.install()
    tvmscript_frames.install()
    assert all(m.inspect is tvmscript_frames._SHIM for m in _tvm_users())
    assert tvmscript_frames._SHIM.signature is inspect.signature  # the rest is the stdlib's
    assert inspect.stack is not tvmscript_frames.stack  # the stdlib module is left alone


def test_ir_module_class_parses_with_the_light_frames():
    """``@I.ir_module`` on a class: the parser finds the class from the current line of the frame
    two up (``is_defined_in_class``), which the light stack gives as the stdlib does."""
    import tvm
    from tvm.script import ir as I
    from tvm.script import tirx as T

    tvmscript_frames.install()

    @I.ir_module
    class Module:
        @T.prim_func
        def main(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = a[i] * T.float32(2)

    assert isinstance(Module, tvm.IRModule) and [g.name_hint for g in Module.get_global_vars()] == ["main"]
