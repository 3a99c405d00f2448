"""PositionTables (tvmfuse/llm/positions.py): a cache-less LM's arange(S) position math becomes a
gather of a constant table at per-sequence ``positions`` (B, S).

Models are written the way users write them (transformers-style RoPE from ``arange`` and
``inv_freq``, GPT-2's learned ``wpe[arange(S)]``) and imported with symbolic B and S by compile_lm's
importer. Checked: the arange is gone, the table is gathered at the new ``positions`` parameter,
the result equals the Before module at positions 0..S-1 and the torch formula at shifted (cache)
positions; values that are not a function of the position alone are refused, naming the binding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax
from tvm.ir.expr import Constant

from tvmfuse.errors import CompileError
from tvmfuse.llm.import_lm import import_lm
from tvmfuse.llm.positions import PositionTables

MAX_SEQ, VOCAB, DIM = 16, 32, 8


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Embedding, then RoPE with cos/sin computed from arange(S) and inv_freq (transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, DIM, 2).float() / DIM))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + rotate_half(x) * emb.sin()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rope(self.embed(ids), torch.arange(ids.shape[1])[None])


class Learned(nn.Module):
    """GPT-2: token embedding + wpe[arange(S)]."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_SEQ, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))


def _ops(func: relax.Function) -> list[relax.Call]:
    calls = []
    relax.analysis.post_order_visit(
        func.body, lambda e: isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and calls.append(e))
    return calls


def run_llvm(mod: tvm.IRModule, *arrays: np.ndarray) -> np.ndarray:
    """``main``'s result (the importer's ``(logits,)`` unwrapped)."""
    mod = relax.transform.LegalizeOps()(mod)
    out = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in arrays])
    return (out[0] if not hasattr(out, "numpy") else out).numpy()


def _import(model: nn.Module) -> tvm.IRModule:
    torch.manual_seed(0)
    return import_lm(model.eval(), MAX_SEQ, max_batch=2)


@pytest.fixture(scope="module", params=[Rope, Learned])
def case(request):
    torch.manual_seed(0)
    model = request.param().eval()
    before = _import(model)
    return model, before, PositionTables(MAX_SEQ)(before)


def test_arange_becomes_a_gather_at_positions(case):
    _, before, after = case
    func = after["main"]
    assert [str(p.name) for p in func.params] == ["ids", "positions"]
    batch, seq = func.params[0].ty.shape.values
    assert func.params[1].ty.dtype == "int64"
    assert func.params[1].ty.shape.values[0].same_as(batch) and func.params[1].ty.shape.values[1].same_as(seq)
    assert "relax.arange" in [c.op.name for c in _ops(before["main"])]
    assert "relax.arange" not in [c.op.name for c in _ops(func)]
    # the table: a constant with max_seq rows along the gathered axis, read at `positions`
    tables = [c for c in _ops(func) if c.op.name == "relax.take" and isinstance(c.args[0], Constant)
              and MAX_SEQ in [int(d) for d in c.args[0].value.shape]]
    assert tables
    assert len(before["main"].params) == 1  # the input module is left as it was


def test_numerics_at_cache_positions(case):
    model, before, after = case
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (2, 5)).astype("int64")
    pos = np.broadcast_to(np.arange(5), (2, 5)).astype("int64")
    np.testing.assert_allclose(run_llvm(after, ids, pos), run_llvm(before, ids), rtol=1e-5, atol=1e-6)
    # a cache step: sequence 0 at positions 3..7, sequence 1 at 9..13 (left padding differs)
    pos = np.stack([np.arange(3, 8), np.arange(9, 14)]).astype("int64")
    with torch.no_grad():
        t_ids, t_pos = torch.from_numpy(ids), torch.from_numpy(pos)
        if isinstance(model, Rope):
            ref = model.rope(model.embed(t_ids), t_pos)
        else:
            ref = model.wte(t_ids) + model.wpe(t_pos)
    np.testing.assert_allclose(run_llvm(after, ids, pos), ref.numpy(), rtol=1e-5, atol=1e-5)


class Reversed(nn.Module):
    """x * flip(arange(S)): row s is S - 1 - s, so no table of positions gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * torch.arange(ids.shape[1]).flip(0).float()[:, None]


class Flattened(nn.Module):
    """A position term over the flattened (S · D) axis: S inside a shape product."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        flat = self.embed(ids).reshape(b, s * DIM) + torch.arange(s * DIM).float()
        return flat.reshape(b, s, DIM)


@pytest.mark.parametrize("model, why", [
    (Reversed, "differs at a position when the length changes"),
    (Flattened, "has S inside a shape product"),
])
def test_unidentified_positions_are_refused_naming_the_binding(model, why):
    before = _import(model())
    with pytest.raises(CompileError, match=rf"cannot derive per-sequence positions: binding '\w+' .*{why}"):
        PositionTables(MAX_SEQ)(before)
