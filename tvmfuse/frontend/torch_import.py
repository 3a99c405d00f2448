"""PyTorch → Relax through ``torch.export`` and ``from_exported_program``.

Accepted: an ``nn.Module`` with example inputs, a ``.pt2`` file (``torch.export.save``), or a
``package.module:factory`` string whose factory returns ``(nn.Module, example_inputs)``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings

from ..errors import InputSpecError, ModelError, UnsupportedOpError
from .spec import ImportedModel, InputOverride, Ranges, TensorSpec, check_override_names, check_symbols
from .symbolic import bound_symbols
from .torch_complex import lower_complex
from .torch_fixes import custom_convert_map
from .torch_moe import moe_convert_map


@contextlib.contextmanager
def quiet_torch_internals():
    """Silence the deprecation torch 2.13 raises against itself: deep-copying an exported
    program's ``LeafSpec`` (``run_decompositions``, ``ep.module()``) warns "`isinstance(treespec,
    LeafSpec)` is deprecated" from copyreg, once per CLI command; nothing a user can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def converters() -> dict:
    """tvmfuse's converters for ``from_exported_program``: TVM's with torch's dtypes
    (torch_fixes.py) and the mixture-of-experts ops TVM lacks (torch_moe.py)."""
    return {**custom_convert_map(), **moe_convert_map()}


def scan_unsupported(ep) -> list[tuple[str, str]]:
    """Every call_function node whose ATen op has no Relax converter, as (node, op)."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    supported = {**ExportedProgramImporter().convert_map, **converters()}
    found = []
    for node in ep.graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            if name not in supported:
                found.append((node.name, name))
    return found


def failed_at(err: BaseException) -> str:
    """Where in the user's model TVM's converter raised ``err``: " at node N (aten op) from
    file:line", with the data-dependent sizes (``.tolist()``, ``.item()``, ``nonzero``) its inputs
    carry, which no converter takes; "" where the traceback names no FX node."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    node, tb = None, err.__traceback__
    while tb is not None:  # the innermost _translate_fx_graph frame holds the node it converts
        if tb.tb_frame.f_code.co_name == "_translate_fx_graph":
            node = tb.tb_frame.f_locals.get("node", node)
        tb = tb.tb_next
    if node is None or not hasattr(node, "meta"):
        return ""

    def origin(n) -> str:  # the model's own line: the last frame of the node's stack trace
        frames = [ln.strip() for ln in (n.meta.get("stack_trace") or "").splitlines()
                  if ln.strip().startswith("File ")]
        return f" ({frames[-1][5:]})" if frames else ""

    where = f" at node {node.name} ({getattr(node.target, '__name__', node.target)}){origin(node)}"
    sources = [a for a in (*node.all_input_nodes, node) if free_unbacked_symbols(a.meta.get("val"))]
    if sources:
        where += (f"; its sizes are data-dependent, read from a tensor at {sources[0].name}"
                  f"{origin(sources[0])} (.tolist(), .item(), nonzero), and tvmfuse needs sizes "
                  "known before run time")
    return where


def _user_inputs(ep, source: str, overrides: dict[str, InputOverride],
                 dynamic: Ranges) -> tuple[list[TensorSpec], dict[str, int | str]]:
    """The user inputs' specs, and how each torch symbol binds: to an int (``--input`` fixed it) or
    to a user symbol (``--input`` named it; its range comes from ``dynamic``)."""
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    check_override_names(overrides, names, source)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    specs, binding = [], {}
    for name in names:
        val = placeholders[name].meta.get("val")
        if val is None or not hasattr(val, "shape"):
            raise ModelError(f"{source}: input {name!r} is not a tensor")
        dims = [int(d) if str(d).lstrip("-").isdigit() else str(d) for d in val.shape]
        dtype = _dtype_name(val.dtype)
        if name not in overrides:
            if any(isinstance(d, str) for d in dims):
                raise InputSpecError(
                    f"{source}: input {name!r} has dynamic dimension(s) (shape {dims}); fix them "
                    f"with --input {name}:" + "x".join(str(d) if isinstance(d, int) else "N"
                                                       for d in dims)
                    + ", or name them (--input " + name + ":" + "x".join(
                        str(d) if isinstance(d, int) else "S" for d in dims)
                    + ") and give their range (--dynamic S=LO..HI)"
                )
            specs.append(TensorSpec(name, tuple(dims), dtype))
            continue
        ov = overrides[name]
        if len(ov.shape) != len(dims) or any(
            isinstance(d, int) and d != v for d, v in zip(dims, ov.shape)
        ):
            raise InputSpecError(
                f"{source}: --input {name} shape {list(ov.shape)} does not fit the exported "
                f"shape {dims}"
            )
        if ov.dtype and ov.dtype != dtype:
            raise InputSpecError(
                f"{source}: --input {name} dtype {ov.dtype} differs from the exported {dtype}"
            )
        for d, v in zip(dims, ov.shape):
            if isinstance(d, str):
                if binding.setdefault(d, v) != v:
                    raise InputSpecError(
                        f"{source}: exported dimension {d} is one length, but --input gives it as "
                        f"both {binding[d]} and {v}"
                    )
        specs.append(TensorSpec(name, ov.shape, dtype))
    check_symbols(specs, dynamic, source)
    _check_ranges(ep, binding, dynamic, source)
    return specs, binding


def _check_ranges(ep, binding: dict[str, int | str], dynamic: Ranges, source: str) -> None:
    """A user range must lie within the range the program was exported for (its guards hold there)."""
    exported = {str(sym): (r.lower, r.upper) for sym, r in ep.range_constraints.items()}
    for sym, value in binding.items():
        if sym not in exported:
            continue
        lo, hi = (_finite(b) for b in exported[sym])
        # torch traces sizes as >= 2 (its 0/1 specialisation); a Dim.AUTO export records 2 where
        # the strict Dim(min=1) export of the same graph records 1
        lo = 1 if lo == 2 else lo
        want = dynamic[value] if isinstance(value, str) else (value, value)
        if (lo is not None and want[0] < lo) or (hi is not None and want[1] > hi):
            raise InputSpecError(
                f"{source}: {value!r} = {want[0]}..{want[1]} lies outside the range "
                f"{lo}..{'inf' if hi is None else hi} the program was exported for (dimension {sym})"
            )


def _finite(bound) -> int | None:
    """A sympy range bound as an int; None for +-infinity (torch's ``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError):
        return None


def decompose(ep, source: str):
    """``ep.run_decompositions()``; where that fails, again with every ``aten.view`` made an
    ``aten.reshape`` (a copy where the strides need one). torch decomposes SDPA into math whose
    output strides differ from the fused kernel's that the export traced, so a later ``view`` of
    the (B, S, E) attention output can fail with a symbolic batch (GPT-2's Conv1D
    ``x.view(-1, E)`` at ``compile_lm(max_batch > 1)``); the graph is functional, so a reshape
    computes the same values. ``ep`` itself is left as it was."""
    import torch

    try:
        with quiet_torch_internals():
            return ep.run_decompositions()
    except Exception as err:  # noqa: BLE001 - torch raises many kinds; the retry decides
        first = err
    views = [n for n in ep.graph.nodes if n.op == "call_function"
             and n.target == torch.ops.aten.view.default]
    if not views:
        raise ModelError(f"{source}: torch decomposition failed: {first}") from first
    for node in views:
        node.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    try:
        with quiet_torch_internals():
            return ep.run_decompositions()
    except Exception:  # noqa: BLE001 - report the first failure, the one of the plain path
        raise ModelError(f"{source}: torch decomposition failed: {first}") from first
    finally:  # the caller's program keeps its views
        for node in views:
            node.target = torch.ops.aten.view.default
        ep.graph_module.recompile()


def import_exported(ep, overrides: dict[str, InputOverride], source: str, reference=None,
                    dynamic: Ranges | None = None) -> ImportedModel:
    """Import a ``torch.export.ExportedProgram``; its symbolic dims are fixed or named by
    ``overrides`` (``1xS``) and bounded by ``dynamic`` (``{"S": (1, 4096)}``)."""
    from tvm.relax.frontend.torch import from_exported_program

    dynamic = dynamic or {}
    ep = decompose(ep, source)
    if reference is None:  # torch's own program (complex tensors and all)
        with quiet_torch_internals():
            module = ep.module()
        reference = _torch_reference(module)
    # Relax has no complex dtype: complex tensors become (real, imaginary) pairs
    ep = lower_complex(ep, source)
    unsupported = scan_unsupported(ep)
    if unsupported:
        raise UnsupportedOpError(f"PyTorch ({source})", unsupported)
    specs, binding = _user_inputs(ep, source, overrides, dynamic)
    try:
        mod = from_exported_program(ep, keep_params_as_input=False, run_ep_decomposition=False,
                                    custom_convert_map=converters())
    except Exception as err:
        raise ModelError(f"{source}: torch import failed{failed_at(err)}: {type(err).__name__}: "
                         f"{err}") from err
    mod = bound_symbols(mod, dynamic, binding)
    ret = mod["main"].ret_ty
    n_out = len(ret.fields) if hasattr(ret, "fields") else 1
    return ImportedModel(mod, specs, [f"output{i}" for i in range(n_out)], "torch", source, reference,
                         dynamic)


def _torch_reference(module):
    def run(*arrays):
        import torch

        with torch.no_grad():
            out = module(*[torch.from_numpy(a) for a in arrays])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().float().numpy() if o.dtype == torch.bfloat16 else o.detach().numpy()
                for o in outs]

    return run


def import_module(module, example_inputs: tuple, overrides: dict[str, InputOverride],
                  source: str | None = None, dynamic: Ranges | None = None) -> ImportedModel:
    """Export an ``nn.Module`` with ``example_inputs`` and import it.

    ``overrides`` re-make example inputs at fixed shapes, or name dimensions by symbol (``1xS``);
    a named dimension is exported dynamic (``torch.export.Dim(S, min=lo, max=hi)`` from ``dynamic``,
    one ``Dim`` per symbol, so equal symbols are one length) and imported as a bounded ``tir.Var``.
    """

    source = source or f"nn.Module {type(module).__name__}"
    module = module.eval()
    dynamic = dynamic or {}
    example_inputs = _unaliased(example_inputs)
    example_inputs, dynamic_shapes = _dynamic_examples(module, example_inputs, overrides, dynamic,
                                                       source)
    try:
        with quiet_torch_internals():
            ep = export_with_dims(module, example_inputs, dynamic_shapes)
    except Exception as err:
        raise ModelError(f"{source}: torch.export failed: {type(err).__name__}: {err}") from err
    from torch.export.graph_signature import InputKind

    names = _forward_params(module)[: len(example_inputs)] if overrides else []
    ep_names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    named = {ep_name: overrides[name] for name, ep_name in zip(names, ep_names)
             if name in overrides and any(isinstance(d, str) for d in overrides[name].shape)}
    return import_exported(ep, named, source, reference=_torch_reference(module), dynamic=dynamic)


def _unaliased(example_inputs: tuple) -> tuple:
    """``example_inputs`` with each tensor that shares storage with an earlier one cloned.
    torch.export traces aliased inputs as one (``f(x, x)``: the second parameter unused, the
    first read twice), so a library built from them would read one input for both, silently;
    example inputs stand for shapes and dtypes, and the user means separate inputs."""
    import torch
    from torch.utils import _pytree

    seen: set[int] = set()

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        key = x.untyped_storage().data_ptr()
        if key in seen and x.numel():
            return x.clone()
        seen.add(key)
        return x

    return tuple(_pytree.tree_map(fresh, tuple(example_inputs)))


def export_with_dims(module, args: tuple, dynamic_shapes: tuple | None):
    """``torch.export.export`` with named ``Dim``s; when torch fails to prove one of its own guards
    over a ``Dim``'s range (torch 2.11 cannot show ``min(16*S, 32*S) == 16*S`` for S in 2..64 in
    transformers' GQA reshape, which 2.13 proves), export again with ``Dim.AUTO`` hints of the
    same ranges — the guard then narrows the range instead of failing — and require every named
    dimension to stay symbolic over its whole range (the original error otherwise)."""
    import torch
    from torch.export.dynamic_shapes import _Dim

    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except torch._dynamo.exc.UserError as err:
        if dynamic_shapes is None:
            raise
        first = err

    def hint(d):
        return torch.export.Dim.AUTO(min=d.min, max=d.max) if isinstance(d, _Dim) else d

    hinted = tuple(None if s is None else {i: hint(d) for i, d in s.items()} for s in dynamic_shapes)
    try:
        ep = torch.export.export(module, args, dynamic_shapes=hinted)
    except Exception:
        raise first from None
    ranges = {str(sym): (r.lower, r.upper) for sym, r in ep.range_constraints.items()}
    users = [n for n in ep.graph.nodes if n.op == "placeholder"
             and n.name in {s.arg.name for s in ep.graph_signature.input_specs
                            if s.kind.name == "USER_INPUT"}]
    for node, dims in zip(users, dynamic_shapes):
        for axis, d in (dims or {}).items():
            lo, hi = ranges.get(str(node.meta["val"].shape[axis]), (d.max + 1, 0))
            if _finite(lo) > max(d.min, 2) or hi < d.max:  # 2: see _check_ranges
                raise first
    return ep


def _dynamic_examples(module, example_inputs: tuple, overrides: dict[str, InputOverride],
                      dynamic: Ranges, source: str) -> tuple[tuple, tuple | None]:
    """Example inputs at the override shapes (a symbol: the example's own length when in range,
    else the range's nearest end), and ``torch.export``'s ``dynamic_shapes`` for the symbols."""
    import torch

    if not overrides and not dynamic:
        return example_inputs, None
    sig = _forward_params(module)[: len(example_inputs)]
    check_override_names(overrides, sig, source)
    check_symbols([TensorSpec(n, overrides[n].shape if n in overrides else tuple(ex.shape), "")
                   for n, ex in zip(sig, example_inputs)], dynamic, source)
    dims = {name: torch.export.Dim(name, min=lo, max=hi) for name, (lo, hi) in dynamic.items()}
    new, shapes = [], []
    for name, ex in zip(sig, example_inputs):
        ov = overrides.get(name)
        if ov is None:
            new.append(ex)
            shapes.append(None)
            continue
        if len(ov.shape) != ex.dim():
            raise InputSpecError(f"{source}: --input {name} rank {len(ov.shape)} != {ex.dim()}")
        size = tuple(d if isinstance(d, int) else min(max(e, dynamic[d][0]), dynamic[d][1])
                     for d, e in zip(ov.shape, ex.shape))
        new.append(ex if size == tuple(ex.shape) else _random_like(ex, size))
        sym = {i: dims[d] for i, d in enumerate(ov.shape) if isinstance(d, str)}
        shapes.append(sym or None)
    return tuple(new), (tuple(shapes) if dims else None)


def _forward_params(module) -> list[str]:
    import inspect

    return [p for p in inspect.signature(module.forward).parameters if p != "self"]


def _random_like(ex, shape):
    import torch

    if ex.dtype.is_floating_point:
        return torch.randn(shape, dtype=ex.dtype)
    return torch.randint(0, 2, shape, dtype=ex.dtype)


def import_pt2(path: str, overrides: dict[str, InputOverride],
               dynamic: Ranges | None = None) -> ImportedModel:
    """Import a ``.pt2`` file written by ``torch.export.save``."""
    import torch

    if not os.path.isfile(path):
        raise ModelError(f"PyTorch program {path!r} does not exist")
    try:
        with quiet_torch_internals():
            ep = torch.export.load(path)
    except Exception as err:
        ep = _load_with_transformers_ops(path)
        if ep is None:
            why = f"{type(err).__name__}: {err}"
            raise ModelError(f"{path}: not a readable torch.export .pt2 file ({why})") from err
    return import_exported(ep, overrides, path, dynamic=dynamic)


def _load_with_transformers_ops(path: str):
    """``torch.export.load`` again once transformers' custom ops are registered (a MoE model's
    ``transformers::grouped_mm_fallback``: the program names an op the loader cannot resolve
    otherwise); None when transformers is absent or the load still fails."""
    import importlib.util

    import torch

    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        importlib.import_module("transformers.integrations.moe")
        with quiet_torch_internals():
            return torch.export.load(path)
    except Exception:  # noqa: BLE001 - the first error is the one reported
        return None


def load_factory(spec: str):
    """Resolve ``package.module:factory`` (the working directory is importable) and call it."""
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as err:
        raise ModelError(f"cannot import factory {spec!r}: {err}") from err
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ModelError(f"factory {spec!r} must return (torch.nn.Module, example_inputs)")
    return result


def import_factory(spec: str, overrides: dict[str, InputOverride],
                   dynamic: Ranges | None = None) -> ImportedModel:
    """Import the module that ``package.module:factory`` builds."""
    module, example_inputs = load_factory(spec)
    return import_module(module, tuple(example_inputs), overrides, source=spec, dynamic=dynamic)


__all__ = ["failed_at", "import_exported", "import_factory", "import_module", "import_pt2",
           "load_factory", "scan_unsupported"]


