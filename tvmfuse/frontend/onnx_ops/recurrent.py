"""ONNX ``RNN``, ``GRU`` and ``LSTM`` (opsets 7–22) unrolled over their static sequence length.

Per direction d (``forward``, ``reverse``, both for ``bidirectional``), with X (S, B, I) (layout 0;
layout 1 is (B, S, I) and transposes in and out), W[d] (G·H, I), R[d] (G·H, H), B[d] = [Wb, Rb]::

    XW = X·W[d]ᵀ + Wb                                  one matmul for all steps
    RNN:  H' = f(XW_t + H·Rᵀ + Rb)
    GRU:  z = f(XW_z + H·R_zᵀ + Rb_z)   r = f(XW_r + H·R_rᵀ + Rb_r)
          ĥ = g(XW_h + (r⊙H)·R_hᵀ + Rb_h)            linear_before_reset=0
          ĥ = g(XW_h + r⊙(H·R_hᵀ + Rb_h))            linear_before_reset=1
          H' = (1 − z)⊙ĥ + z⊙H
    LSTM: i = f(XW_i + H·R_iᵀ + Rb_i + P_i⊙C)  f = f(… + P_f⊙C)  c = g(…)
          C' = f⊙C + i⊙c    o = f(XW_o + H·R_oᵀ + Rb_o + P_o⊙C')    H' = o⊙h(C')

Gate rows are ordered z, r, h (GRU) and i, o, f, c (LSTM). ``clip`` clamps every gate's
pre-activation to [−clip, clip]. ``sequence_lens`` masks step t of batch row b when t ≥ len[b]:
the state is kept and Y is 0 there (the reverse direction runs t = S−1 … 0, so a short row
starts at its own last step). Outputs: Y (S, D, B, H), Y_h / Y_c (D, B, H) (layout 1:
(B, S, D, H), (B, D, H)). Activations with their default parameters; ``activation_alpha`` /
``activation_beta`` are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import static_shape
from ._common import dtype_of, refuse

_ACTIVATIONS: dict[str, Callable[[relax.Expr], relax.Expr]] = {
    "tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid, "relu": relax.op.nn.relu,
    "softsign": lambda x: relax.op.divide(x, relax.op.add(relax.op.abs(x), relax.const(1.0, dtype_of(x)))),
    "softplus": lambda x: relax.op.log(relax.op.add(relax.op.exp(x), relax.const(1.0, dtype_of(x)))),
}


@dataclass
class _Cell:
    """One recurrent op: gate count, default activations and its step function."""

    op: str
    gates: int
    activations: tuple[str, ...]


_CELLS = {"RNN": _Cell("RNN", 1, ("Tanh",)), "GRU": _Cell("GRU", 3, ("Sigmoid", "Tanh")),
          "LSTM": _Cell("LSTM", 4, ("Sigmoid", "Tanh", "Tanh"))}


def _part(x: relax.Expr, axis: int, begin: int, end: int) -> relax.Expr:
    return relax.op.strided_slice(x, [axis], [begin], [end])


def _row(x: relax.Expr, i: int) -> relax.Expr:
    """``x[i]`` (axis 0 dropped)."""
    return relax.op.squeeze(_part(x, 0, i, i + 1), [0])


def _initial(bb, value: relax.Expr | None, d: int, batch: int, hidden: int, dtype: str) -> relax.Expr:
    """Direction ``d``'s initial state (B, H): ``value[d]``, zeros when absent."""
    return bb.normalize(_row(value, d) if value is not None else relax.op.zeros((batch, hidden), dtype))


def _input(inputs: list, i: int) -> relax.Expr | None:
    return inputs[i] if len(inputs) > i and inputs[i] is not None else None


class _Recurrent(stock.OnnxOpConverter):
    """The unrolled recurrence shared by RNN / GRU / LSTM (see the module docstring)."""

    cell: _Cell

    @classmethod
    def _activations(cls, attr: dict, directions: int) -> list[list[Callable]]:
        for name in ("activation_alpha", "activation_beta"):
            if attr.get(name):
                raise refuse(attr, cls.cell.op, f"attribute {name}={attr[name]!r}")
        names = [a.decode() if isinstance(a, bytes) else a for a in attr.get("activations", [])]
        n = len(cls.cell.activations)
        names = names or list(cls.cell.activations) * directions
        if len(names) != n * directions:
            raise refuse(attr, cls.cell.op, f"attribute activations={names!r} (expected {n * directions})")
        unknown = [a for a in names if a.lower() not in _ACTIVATIONS]
        if unknown:
            raise refuse(attr, cls.cell.op,
                         f"attribute activations={names!r} ({unknown[0]} is not supported)")
        fns = [_ACTIVATIONS[a.lower()] for a in names]
        return [fns[d * n:(d + 1) * n] for d in range(directions)]

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr)

    @classmethod
    def _convert(cls, bb, inputs, attr):
        op, gates = cls.cell.op, cls.cell.gates
        x, w, r = inputs[0], inputs[1], inputs[2]
        bias, lens, h0 = _input(inputs, 3), _input(inputs, 4), _input(inputs, 5)
        c0, peep = (_input(inputs, 6), _input(inputs, 7)) if op == "LSTM" else (None, None)
        layout = attr.get("layout", 0)
        direction = attr.get("direction", b"forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        if direction not in ("forward", "reverse", "bidirectional"):
            raise refuse(attr, op, f"attribute direction={direction!r}")
        if op == "LSTM" and attr.get("input_forget", 0):
            raise refuse(attr, op, f"attribute input_forget={attr['input_forget']}")
        if static_shape(x) is None or static_shape(w) is None:
            raise refuse(attr, op, "input X / W without a static shape")
        dtype = dtype_of(x)
        if layout:
            x = relax.op.permute_dims(x, [1, 0, 2])
            h0 = None if h0 is None else relax.op.permute_dims(h0, [1, 0, 2])
            c0 = None if c0 is None else relax.op.permute_dims(c0, [1, 0, 2])
        x = bb.normalize(x)
        seq, batch, _ = static_shape(x)
        dirs, gh, _ = static_shape(w)
        hidden = gh // gates
        acts = cls._activations(attr, dirs)
        clip = attr.get("clip")
        zero = relax.const(0.0, dtype)
        masks = None
        if lens is not None:
            lens = bb.normalize(relax.op.reshape(relax.op.astype(lens, "int64"), [batch, 1]))
            masks = [bb.normalize(relax.op.less(relax.const(t, "int64"), lens)) for t in range(seq)]
        ys, hs, cs = [], [], []
        for d in range(dirs):
            reverse = direction == "reverse" or d == 1
            wd, rd = bb.normalize(_row(w, d)), bb.normalize(_row(r, d))
            xw = relax.op.matmul(x, relax.op.permute_dims(wd))
            rb = None
            if bias is not None:
                bd = bb.normalize(_row(bias, d))
                xw = relax.op.add(xw, _part(bd, 0, 0, gh))
                rb = bb.normalize(_part(bd, 0, gh, 2 * gh))
            xw = bb.normalize(xw)
            state = {"h": _initial(bb, h0, d, batch, hidden, dtype)}
            if op == "LSTM":
                state["c"] = _initial(bb, c0, d, batch, hidden, dtype)
            p = None if peep is None else bb.normalize(_row(peep, d))
            step = _Step(bb, cls.cell, acts[d], rd, rb, p, hidden, clip, attr.get("linear_before_reset", 0))
            outs: list = [None] * seq
            for t in (range(seq - 1, -1, -1) if reverse else range(seq)):
                new = step(bb.normalize(_row(xw, t)), state)
                if masks is not None:
                    outs[t] = bb.normalize(relax.op.where(masks[t], new["h"], zero))
                    new = {k: bb.normalize(relax.op.where(masks[t], v, state[k])) for k, v in new.items()}
                else:
                    outs[t] = new["h"]
                state = new
            ys.append(bb.normalize(relax.op.stack(outs, axis=0)))
            hs.append(state["h"])
            cs.append(state.get("c"))
        y = relax.op.stack(ys, axis=1)  # (S, D, B, H)
        y_h = relax.op.stack(hs, axis=0)
        results = [y, y_h] + ([relax.op.stack(cs, axis=0)] if op == "LSTM" else [])
        if layout:
            results = [relax.op.permute_dims(results[0], [2, 0, 1, 3])] + [
                relax.op.permute_dims(v, [1, 0, 2]) for v in results[1:]]
        return relax.Tuple([bb.normalize(v) for v in results])


class _Step:
    """One time step of a cell: ``state`` ({"h"[, "c"]}) → the next state."""

    def __init__(self, bb, cell: _Cell, acts: list[Callable], r: relax.Expr, rb: relax.Expr | None,
                 peep: relax.Expr | None, hidden: int, clip: float | None, linear_before_reset: int):
        self.bb, self.cell, self.acts, self.hidden = bb, cell, acts, hidden
        self.r, self.rb, self.peep, self.clip, self.lbr = r, rb, peep, clip, linear_before_reset

    def _gate(self, x: relax.Expr, k: int) -> relax.Expr:
        return _part(x, 1, k * self.hidden, (k + 1) * self.hidden)

    def _act(self, i: int, x: relax.Expr) -> relax.Expr:
        if self.clip is not None:
            x = relax.op.clip(x, -float(self.clip), float(self.clip))
        return self.acts[i](x)

    def _peep(self, k: int, c: relax.Expr) -> relax.Expr | None:
        if self.peep is None:
            return None
        return relax.op.multiply(_part(self.peep, 0, k * self.hidden, (k + 1) * self.hidden), c)

    def __call__(self, xw: relax.Expr, state: dict) -> dict:
        bb, h, hid = self.bb, state["h"], self.hidden
        gates = self.cell.gates
        rows = (gates - 1) * hid if self.cell.op == "GRU" and not self.lbr else gates * hid
        hr = relax.op.matmul(h, relax.op.permute_dims(_part(self.r, 0, 0, rows)))
        if self.rb is not None:
            hr = relax.op.add(hr, _part(self.rb, 0, 0, rows))
        hr = bb.normalize(hr)
        if self.cell.op == "RNN":
            return {"h": bb.normalize(self._act(0, relax.op.add(xw, hr)))}
        if self.cell.op == "GRU":
            z = bb.normalize(self._act(0, relax.op.add(self._gate(xw, 0), self._gate(hr, 0))))
            rg = bb.normalize(self._act(0, relax.op.add(self._gate(xw, 1), self._gate(hr, 1))))
            if self.lbr:
                rec = relax.op.multiply(rg, self._gate(hr, 2))
            else:
                rec = relax.op.matmul(relax.op.multiply(rg, h),
                                      relax.op.permute_dims(_part(self.r, 0, 2 * hid, 3 * hid)))
                if self.rb is not None:
                    rec = relax.op.add(rec, _part(self.rb, 0, 2 * hid, 3 * hid))
            hh = bb.normalize(self._act(1, relax.op.add(self._gate(xw, 2), rec)))
            one = relax.const(1.0, dtype_of(hh))
            return {"h": bb.normalize(relax.op.add(relax.op.multiply(relax.op.subtract(one, z), hh),
                                                   relax.op.multiply(z, h)))}
        pre = bb.normalize(relax.op.add(xw, hr))
        c = state["c"]

        def gate(k: int, act: int, peep_k: int | None, cell: relax.Expr | None = None) -> relax.Expr:
            v = self._gate(pre, k)
            extra = None if peep_k is None else self._peep(peep_k, cell)
            return bb.normalize(self._act(act, v if extra is None else relax.op.add(v, extra)))

        i, f, g = gate(0, 0, 0, c), gate(2, 0, 2, c), gate(3, 1, None)
        c_new = bb.normalize(relax.op.add(relax.op.multiply(f, c), relax.op.multiply(i, g)))
        o = gate(1, 0, 1, c_new)
        return {"h": bb.normalize(relax.op.multiply(o, self.acts[2](c_new))), "c": c_new}


class RNN(_Recurrent):
    """ONNX ``RNN``."""

    cell = _CELLS["RNN"]


class GRU(_Recurrent):
    """ONNX ``GRU``."""

    cell = _CELLS["GRU"]


class LSTM(_Recurrent):
    """ONNX ``LSTM``."""

    cell = _CELLS["LSTM"]
