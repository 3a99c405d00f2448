"""The schedule rules' one fallback point (tvmfuse/rules/fallback.py): an exception inside a
rule propagates under TVMFUSE_STRICT; otherwise the kernel is scheduled by the next rule and the
reason, with the exception's text, is recorded and shown by ``tvmfuse report``."""

from __future__ import annotations

import pytest
import torch
import tvm
from torch import nn
from tvm import te
from tvm.s_tir import dlight as dl

from tvmfuse import pipeline
from tvmfuse.errors import CompileError
from tvmfuse.frontend import import_model
from tvmfuse.options import Options, use_options
from tvmfuse.report import analyze, format_table
from tvmfuse.rules import gpu_rules
from tvmfuse.rules.fallback import ApplyRules
from tvmfuse.rules.gemm_sm80 import FALLBACK_ATTR
from tvmfuse.targets import get_target

SM90 = get_target("sm90")


class Broken:
    """A rule with a bug: it raises on every function."""

    def apply(self, func, target, tunable):
        raise KeyError("boom: a bug in a rule")


def _module() -> tvm.IRModule:
    x = te.placeholder((64, 256), "float16", name="x")
    y = te.compute((64, 256), lambda i, j: x[i, j] * 2, name="y")
    return tvm.IRModule({"main": te.create_prim_func([x, y])})


def test_strict_propagates():
    with SM90.tvm_target(), use_options(Options(strict=True)), pytest.raises(KeyError, match="boom"):
        ApplyRules(Broken(), dl.gpu.Fallback())(_module())


def test_strict_is_the_test_suite_default():
    assert Options().strict  # tests/conftest.py sets TVMFUSE_STRICT=1


def test_recorded_without_strict():
    mod = _module()
    with SM90.tvm_target(), use_options(Options(strict=False)):
        out = ApplyRules(Broken(), *gpu_rules())(mod)
    func = out["main"]
    assert func.attrs["tirx.is_scheduled"], "the next rule must still schedule it"
    assert str(func.attrs[FALLBACK_ATTR]) == "Broken raised KeyError: 'boom: a bug in a rule'"
    assert FALLBACK_ATTR not in (mod["main"].attrs or {}), "the input module must not change"


class _Double(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def test_report_shows_the_reason(monkeypatch):
    """``tvmfuse report`` on a model as a user writes it: the kernel the broken rule raised on
    carries the reason; in strict mode the compile fails naming the stage."""
    monkeypatch.setattr(pipeline, "gpu_rules", lambda: [Broken(), *gpu_rules()])
    imported = import_model(_Double(), (torch.randn(8, 128).half(),), {})
    with use_options(Options(strict=False)):
        report = analyze(imported.mod, SM90)
    (kernel,) = report["kernels"]
    assert "Broken raised KeyError" in kernel["fallback"]
    assert "Broken raised KeyError: 'boom: a bug in a rule'" in format_table(report)
    with use_options(Options(strict=True)), pytest.raises(CompileError, match="(?s)schedule.*boom"):
        analyze(imported.mod, SM90)
