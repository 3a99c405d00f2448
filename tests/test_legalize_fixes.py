"""tvmfuse's legalisation overrides: numerics on the cpu target and the shape of the TIR."""

from __future__ import annotations

import pytest
import torch

import tvmfuse
from tvmfuse.passes.legalize_fixes import legalize_overrides


class Softmax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_softmax_sums_in_fp32(dtype):
    """Rows of 4096 wide-ranging values: the fp32 sum keeps rel err at the output's rounding."""
    torch.manual_seed(0)
    x = (torch.randn(8, 4096) * 4).to(dtype)
    out = tvmfuse.compile(Softmax(), (x,), target="cpu").load(device="cpu")(x)
    ref = torch.softmax(x.double(), -1)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < (2e-3 if dtype == torch.float16 else 1e-2), err


def test_half_softmax_tir_uses_exp2_and_fp32_reductions():
    """The legalised softmax reads fp16, keeps max / exp / sum in fp32 and exponentiates with exp2."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.softmax(x, axis=-1))
        bb.emit_func_output(y)
    func = relax.transform.LegalizeOps(legalize_overrides())(bb.get())["softmax"]
    root = func.body.block  # the root block allocates the intermediates
    dtypes = {b.name: str(b.dtype) for b in root.alloc_buffers}
    assert dtypes == {"T_softmax_maxelem": "float32", "T_softmax_exp": "float32",
                      "T_softmax_expsum": "float32"}
    text = func.script()
    assert "T.exp2(" in text and "T.exp(" not in text
    assert str(func.params[-1].dtype) == "float16"
