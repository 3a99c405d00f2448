"""Symbolic input dimensions at import: ``inputs={"x": "1xS"}`` + ``dynamic={"S": (lo, hi)}``.

The imported ``main`` takes ``R.Tensor((1, S))`` with one ``tir.Var`` per symbol (shared by every
input that names it) and ``tir_var_lower_bound`` / ``tir_var_upper_bound`` set to the range; ONNX
``dim_param``s named in ``dynamic`` stay symbolic; a symbol without a range, a range no dimension
uses and an exported program's narrower range are InputSpecErrors.
"""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from tvm import relax, tirx

from tvmfuse.errors import InputSpecError, ModelError
from tvmfuse.frontend import dynamic_ranges, import_model, input_overrides, parse_input_override


class AddMatmul(torch.nn.Module):
    """``(x + y) @ w`` on (B, S, 16) inputs: x and y share S."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) @ self.w


def _param_shapes(mod) -> list[list]:
    return [list(p.ty.shape.values) for p in mod["main"].params]


def _bounds(mod) -> tuple[dict, dict]:
    attrs = mod["main"].attrs
    return ({str(k): int(v) for k, v in attrs["tir_var_lower_bound"].items()},
            {str(k): int(v) for k, v in attrs["tir_var_upper_bound"].items()})


def test_parse_symbolic_shapes_and_ranges():
    assert parse_input_override("ids:1xS")[1].shape == (1, "S")
    assert parse_input_override("ids:B,max_len,8:int64")[1].shape == ("B", "max_len", 8)
    assert dynamic_ranges(["S=1..4096"]) == {"S": (1, 4096)}
    assert dynamic_ranges({"S": "2..8", "B": (1, 4)}) == {"S": (2, 8), "B": (1, 4)}
    with pytest.raises(InputSpecError, match=r"1 <= lo <= hi"):
        dynamic_ranges({"S": (8, 2)})
    with pytest.raises(InputSpecError, match=r"SYMBOL=LO\.\.HI"):
        dynamic_ranges(["S=1-8"])
    with pytest.raises(InputSpecError, match=r"symbol names"):
        parse_input_override("ids:1x-S")


def test_torch_module_symbol_shared_across_inputs():
    x = torch.randn(2, 5, 16)
    imported = import_model(AddMatmul(), (x, x.clone()), input_overrides({"x": "2xSx16", "y": "2xSx16"}),
                            {"S": (1, 64)})
    (_, s_x, _), (_, s_y, _) = _param_shapes(imported.mod)
    assert isinstance(s_x, tirx.Var) and s_x.name == "S" and s_x.same_as(s_y)
    assert _bounds(imported.mod)[0]["S"] == 1 and _bounds(imported.mod)[1]["S"] == 64
    assert [s.shape for s in imported.inputs] == [(2, "S", 16), (2, "S", 16)]
    assert imported.dynamic == {"S": (1, 64)}
    (out,) = imported.mod["main"].ret_ty.fields
    assert isinstance(out, relax.TensorType) and out.shape.values[1].same_as(s_x)


def test_torch_example_outside_range_is_remade_inside():
    x = torch.randn(1, 100, 16)  # 100 > 64: the export example becomes 64 long
    imported = import_model(AddMatmul(), (x, x.clone()), input_overrides({"x": "1xSx16", "y": "1xSx16"}),
                            {"S": (1, 64)})
    assert _bounds(imported.mod)[1]["S"] == 64


def test_exported_program_symbols_are_named_by_inputs():
    x = torch.randn(2, 5, 16)
    s = torch.export.Dim("seq", min=1, max=32)
    ep = torch.export.export(AddMatmul(), (x, x.clone()), dynamic_shapes=({1: s}, {1: s}))
    with pytest.raises(InputSpecError, match=r"dynamic dimension.*--dynamic S=LO\.\.HI"):
        import_model(ep)
    imported = import_model(ep, None, input_overrides({"x": "2xSx16", "y": "2xSx16"}), {"S": (1, 16)})
    assert _param_shapes(imported.mod)[0][1].name == "S"
    assert _bounds(imported.mod)[1]["S"] == 16
    with pytest.raises(InputSpecError, match=r"outside the range 1\.\.32"):
        import_model(ep, None, input_overrides({"x": "2xSx16", "y": "2xSx16"}), {"S": (1, 64)})


def test_symbol_without_range_and_unused_range():
    x = torch.randn(2, 5, 16)
    with pytest.raises(InputSpecError, match=r"\['S'\].*no range.*--dynamic S=LO\.\.HI"):
        import_model(AddMatmul(), (x, x.clone()), input_overrides({"x": "2xSx16", "y": "2xSx16"}), {})
    with pytest.raises(InputSpecError, match=r"--dynamic names \['T'\]"):
        import_model(AddMatmul(), (x, x.clone()), input_overrides({"x": "2xSx16", "y": "2xSx16"}),
                     {"S": (1, 8), "T": (1, 8)})


def _onnx_add() -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", 16]) for n in "xy"]
    out = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "seq", 16])
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnx_dim_params_become_symbols():
    imported = import_model(_onnx_add(), None, {}, {"batch": (1, 4), "seq": (1, 128)})
    (b, s, _), (b2, s2, _) = _param_shapes(imported.mod)
    assert (b.name, s.name) == ("batch", "seq") and b.same_as(b2) and s.same_as(s2)
    assert _bounds(imported.mod) == ({"batch": 1, "seq": 1}, {"batch": 4, "seq": 128})
    # one dim_param fixed, the other renamed by --input
    imported = import_model(_onnx_add(), None, input_overrides({"x": "1xSx16", "y": "1xSx16"}),
                            {"S": (1, 128)})
    assert [s.shape for s in imported.inputs] == [(1, "S", 16), (1, "S", 16)]
    with pytest.raises(InputSpecError, match=r"\['batch', 'seq'\].*--dynamic"):
        import_model(_onnx_add(), None, {}, {})


class _FirstExportFails:
    """``torch.export.export`` whose first call fails like torch 2.11's unproven guard."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def __call__(self, module, args, dynamic_shapes=None, **kw):
        self.calls.append(dynamic_shapes)
        if len(self.calls) == 1:
            raise torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION,
                                              "Constraints violated (S)! (simulated)")
        return self.real(module, args, dynamic_shapes=dynamic_shapes, **kw)


def test_unproven_guard_retried_with_auto_hints(monkeypatch):
    """torch 2.11 fails transformers' Llama with a guard 2.13 proves: the import retries with
    ``Dim.AUTO`` hints of the same range and keeps S symbolic over all of it."""
    fake = _FirstExportFails(torch.export.export)
    monkeypatch.setattr(torch.export, "export", fake)
    x = torch.randn(2, 5, 16)
    imported = import_model(AddMatmul(), (x, x.clone()), input_overrides({"x": "2xSx16", "y": "2xSx16"}),
                            {"S": (1, 64)})
    assert len(fake.calls) == 2 and "AUTO" in str(fake.calls[1])
    assert _bounds(imported.mod) == ({"S": 1}, {"S": 64})


class _FixedLength(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, 5, 4, 4).sum(-1)  # only S = 5 works


def test_retry_that_specialises_reports_the_first_error(monkeypatch):
    """A retry that leaves S fixed is not accepted: the user sees torch's original error."""
    monkeypatch.setattr(torch.export, "export", _FirstExportFails(torch.export.export))
    with pytest.raises(ModelError, match=r"torch.export failed: UserError: .*simulated"):
        import_model(_FixedLength(), (torch.randn(2, 5, 16),), input_overrides({"x": "2xSx16"}),
                     {"S": (1, 64)})
