"""Complex tensors of a torch program as (real, imaginary) pairs, before the import.

Relax has no complex dtype, and rotary embeddings are often written with complex numbers (Meta's
Llama and Mistral reference code, transformers' Llama 4): ``freqs_cis = torch.polar(ones, θ)``
(a complex buffer), ``view_as_complex(x.reshape(..., -1, 2)) * freqs_cis``, ``view_as_real``.
Here every complex tensor ``z`` of shape ``s`` becomes the real tensor ``R(z)`` of shape
``s + (2,)`` (``[..., 0]`` the real part, ``[..., 1]`` the imaginary), which is exactly torch's
``view_as_real(z)``::

    view_as_complex(x)  → x                     view_as_real(z)  → R(z)
    z · w               → (a·c − b·d, a·d + b·c) stacked on the last axis   (a, b = R(z); c, d = R(w))
    z · r (r real)      → R(z) · r[..., None]    z ± w → R(z) ± R(w)
    polar(ρ, θ)         → (ρ·cos θ, ρ·sin θ)      complex(x, y) → (x, y)
    real(z), imag(z)    → R(z)[..., 0], R(z)[..., 1]      (slices: they fuse into their reader)
    view / reshape / expand (shape + (2,)), repeat (+ (1,)), slice / select / unsqueeze / permute /
    cat (the axis counted on z), clone

A complex buffer or constant is stored as its ``view_as_real``; the exporter's
``_assert_tensor_metadata`` checks of complex tensors are dropped. Anything else that reads a complex
tensor (a complex model input, division, ``abs``, FFTs, ...) raises a :class:`ModelError` naming
the node and the op. Programs without complex tensors are returned as they are; others are
rewritten on a copy (the caller's program is left as it was).
"""

from __future__ import annotations

import copy

from ..errors import ModelError

_REAL = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def _is_complex(node) -> bool:
    val = getattr(node, "meta", {}).get("val")
    return getattr(val, "dtype", None) is not None and val.dtype.is_complex


def lower_complex(ep, source: str):
    """``ep`` with its complex tensors as real pairs (module docstring); ``ep`` when it has none."""
    if not any(_is_complex(n) for n in ep.graph.nodes):
        return ep
    ep = copy.deepcopy(ep)
    _Rewrite(ep, source).run()
    return ep


class _Rewrite:
    def __init__(self, ep, source: str) -> None:
        import torch
        from torch._guards import detect_fake_mode

        self.ep, self.source, self.torch = ep, source, torch
        self.graph = ep.graph
        self.aten = torch.ops.aten
        self.fake = detect_fake_mode([n.meta.get("val") for n in self.graph.nodes
                                      if n.op == "placeholder"])
        self.real: dict = {}  # complex node → the node computing its real pair
        self.ranks: dict = {}  # complex placeholders (their value is now the pair) → complex rank

    # --- helpers ------------------------------------------------------------------------------

    def _fail(self, node, what: str) -> ModelError:
        return ModelError(f"{self.source}: node {node.name!r} ({node.target}): {what} (complex "
                          "tensors are computed as (real, imaginary) pairs; this op is not one "
                          "tvmfuse rewrites)")

    def _emit(self, op, *args, **kwargs):
        """A new node ``op(*args, **kwargs)`` before the current one, its fake value computed by
        torch."""
        from torch.fx.node import map_arg

        node = self.graph.call_function(op, args, kwargs)
        fake_args = map_arg(args, lambda a: a.meta["val"])
        with self.fake:
            node.meta["val"] = op(*fake_args, **kwargs)
        return node

    def _rank(self, node) -> int:
        """Rank of the complex tensor ``node`` (not of its pair)."""
        return self.ranks.get(node, len(node.meta["val"].shape))

    def _pair(self, arg):
        """R(arg) for a complex node arg."""
        return self.real[arg]

    def _dim(self, dim: int, rank: int) -> int:
        """Axis ``dim`` of a complex tensor of ``rank`` as an axis of its pair (non-negative)."""
        return dim + rank if dim < 0 else dim

    # --- the rewrite --------------------------------------------------------------------------

    def run(self) -> None:
        for node in list(self.graph.nodes):
            args = [a for a in node.all_input_nodes if a in self.real or _is_complex(a)]
            if node.op == "placeholder":
                if _is_complex(node):
                    self._placeholder(node)
                continue
            if node.op == "output":
                if args:
                    raise self._fail(node, "a complex model output")
                continue
            if not args and not _is_complex(node):
                continue
            with self.graph.inserting_before(node):
                self._call(node)
        for node in reversed(list(self.graph.nodes)):
            if node in self.real and node.op != "placeholder" and not node.users:
                self.graph.erase_node(node)
        self.graph.lint()
        self.ep.graph_module.recompile()

    def _placeholder(self, node) -> None:
        torch = self.torch
        sig = self.ep.graph_signature
        target = next((s.target for s in sig.input_specs if s.arg.name == node.name), None)
        for store in (self.ep.constants, self.ep.state_dict):
            if target in store:
                tensor = store[target]
                pair = torch.view_as_real(tensor.detach()).contiguous()
                store[target] = (torch.nn.Parameter(pair, requires_grad=False)
                                 if isinstance(tensor, torch.nn.Parameter) else pair)
                self.ranks[node] = tensor.dim()
                node.meta["val"] = self.fake.from_tensor(pair, static_shapes=True)
                node.meta.pop("tensor_meta", None)
                self.real[node] = node
                return
        raise self._fail(node, "a complex model input")

    def _call(self, node) -> None:
        aten, torch = self.aten, self.torch
        op, a = node.target, list(node.args)
        z = a[0] if a else None
        rank = self._rank(z) if z is not None and z in self.real else None
        if op == aten._assert_tensor_metadata.default:  # export's dtype check of a complex tensor
            self.graph.erase_node(node)
        elif op == aten.view_as_complex.default:
            self.real[node] = a[0]
        elif op == aten.view_as_real.default:
            node.replace_all_uses_with(self._pair(z))
            self.graph.erase_node(node)
        elif op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                    aten.expand.default):
            self.real[node] = self._emit(op, self._pair(z), [*a[1], 2])
        elif op == aten.repeat.default:
            self.real[node] = self._emit(op, self._pair(z), [*a[1], 1])
        elif op == aten.slice.Tensor:
            dim = a[1] if len(a) > 1 else 0
            self.real[node] = self._emit(op, self._pair(z), self._dim(dim, rank), *a[2:])
        elif op == aten.select.int:
            self.real[node] = self._emit(op, self._pair(z), self._dim(a[1], rank), a[2])
        elif op == aten.unsqueeze.default:
            dim = a[1] + rank + 1 if a[1] < 0 else a[1]
            self.real[node] = self._emit(op, self._pair(z), dim)
        elif op == aten.permute.default:
            self.real[node] = self._emit(op, self._pair(z), [self._dim(d, rank) for d in a[1]] + [rank])
        elif op == aten.cat.default:
            parts = a[0]
            if not all(p in self.real for p in parts):
                raise self._fail(node, "cat of complex and real tensors")
            dim = a[1] if len(a) > 1 else 0
            self.real[node] = self._emit(op, [self._pair(p) for p in parts],
                                         self._dim(dim, self._rank(parts[0])))
        elif op in (aten.clone.default, aten.alias.default):
            self.real[node] = self._emit(op, self._pair(z))
        elif op in (aten.mul.Tensor, aten.mul.Scalar):
            self.real[node] = self._mul(node, a[0], a[1])
        elif op in (aten.add.Tensor, aten.sub.Tensor) and all(x in self.real for x in a[:2]):
            if len(a) > 2 or node.kwargs.get("alpha", 1) != 1:
                raise self._fail(node, "add / sub with alpha")
            self.real[node] = self._emit(op, self._pair(a[0]), self._pair(a[1]))
        elif op == aten.polar.default:
            rho, theta = a
            self.real[node] = self._stack(
                self._emit(aten.mul.Tensor, rho, self._emit(aten.cos.default, theta)),
                self._emit(aten.mul.Tensor, rho, self._emit(aten.sin.default, theta)))
        elif op == aten.complex.default:
            self.real[node] = self._stack(a[0], a[1])
        elif op in (aten.real.default, aten.imag.default):
            node.replace_all_uses_with(self._part(self._pair(z), int(op == aten.imag.default)))
            self.graph.erase_node(node)
        elif op in (aten._to_copy.default, aten.to.dtype) and z in self.real:
            dtype = node.kwargs.get("dtype", a[1] if len(a) > 1 else None)
            real = _REAL.get(str(dtype).removeprefix("torch."))
            if real is None:
                raise self._fail(node, f"complex → {dtype}")
            self.real[node] = self._emit(aten._to_copy.default, self._pair(z),
                                         dtype=getattr(torch, real))
        else:
            raise self._fail(node, "an op on complex tensors")

    def _part(self, pair, i: int):
        """``pair[..., i]`` as a slice and a squeeze (TVM imports ``select`` as a ``take``, which
        stays a kernel of its own; slices fuse into their consumer)."""
        aten = self.aten
        return self._emit(aten.squeeze.dim, self._emit(aten.slice.Tensor, pair, -1, i, i + 1), -1)

    def _stack(self, re, im):
        return self._emit(self.aten.stack.default, [re, im], -1)

    def _mul(self, node, x, y):
        aten = self.aten
        cx, cy = x in self.real, y in self.real
        if cx and cy:
            (a, b), (c, d) = ([self._part(self._pair(t), i) for i in (0, 1)] for t in (x, y))
            re = self._emit(aten.sub.Tensor, self._emit(aten.mul.Tensor, a, c),
                            self._emit(aten.mul.Tensor, b, d))
            im = self._emit(aten.add.Tensor, self._emit(aten.mul.Tensor, a, d),
                            self._emit(aten.mul.Tensor, b, c))
            return self._stack(re, im)
        z, r = (x, y) if cx else (y, x)
        if not hasattr(r, "meta"):  # a Python scalar
            if isinstance(r, complex):
                raise self._fail(node, "a complex scalar factor")
            return self._emit(aten.mul.Tensor, self._pair(z), r)
        if _is_complex(r):
            raise self._fail(node, "a complex operand tvmfuse has no pair for")
        return self._emit(aten.mul.Tensor, self._pair(z), self._emit(aten.unsqueeze.default, r, -1))
