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
from .spec import ImportedModel, InputOverride, TensorSpec, check_override_names
from .torch_fixes import custom_convert_map


@contextlib.contextmanager
def _quiet_torch_internals():
    """Silence the deprecation torch 2.13 raises against itself: deep-copying an exported
    program's ``LeafSpec`` (``run_decompositions``, ``ep.module()``) warns "`isinstance(treespec,
    LeafSpec)` is deprecated" from copyreg, once per CLI command; nothing a user can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def scan_unsupported(ep) -> list[tuple[str, str]]:
    """Every call_function node whose ATen op has no Relax converter, as (node, op)."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    supported = ExportedProgramImporter().convert_map
    found = []
    for node in ep.graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            if name not in supported:
                found.append((node.name, name))
    return found


def _user_inputs(ep, source: str, overrides: dict[str, InputOverride]) -> list[TensorSpec]:
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    check_override_names(overrides, names, source)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    specs = []
    for name in names:
        val = placeholders[name].meta.get("val")
        if val is None or not hasattr(val, "shape"):
            raise ModelError(f"{source}: input {name!r} is not a tensor")
        dims = [int(d) if str(d).lstrip("-").isdigit() else str(d) for d in val.shape]
        dtype = _dtype_name(val.dtype)
        if name in overrides:
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
            specs.append(TensorSpec(name, ov.shape, dtype))
        elif any(isinstance(d, str) for d in dims):
            raise InputSpecError(
                f"{source}: input {name!r} has dynamic dimension(s) (shape {dims}); fix them "
                f"with --input {name}:" + "x".join(str(d) if isinstance(d, int) else "N" for d in dims)
            )
        else:
            specs.append(TensorSpec(name, tuple(dims), dtype))
    return specs


def _bind_symbolic(mod, specs: list[TensorSpec]):
    """Replace symbolic dims of ``main``'s parameters by the fixed shapes in ``specs``."""
    from tvm import relax, tirx

    func = mod["main"]
    binding: dict[str, int] = {}
    for param, spec in zip(func.params, specs):
        sinfo = param.ty
        if isinstance(sinfo, relax.TensorType) and sinfo.shape is not None:
            for dim, value in zip(sinfo.shape.values, spec.shape):
                if isinstance(dim, tirx.Var):
                    binding[dim.name] = value
    if binding:
        mod = relax.transform.BindSymbolicVars(binding)(mod)
    return mod


def import_exported(ep, overrides: dict[str, InputOverride], source: str, reference=None) -> ImportedModel:
    """Import a ``torch.export.ExportedProgram``."""
    from tvm.relax.frontend.torch import from_exported_program

    try:
        with _quiet_torch_internals():
            ep = ep.run_decompositions()
    except Exception as err:
        raise ModelError(f"{source}: torch decomposition failed: {err}") from err
    unsupported = scan_unsupported(ep)
    if unsupported:
        raise UnsupportedOpError(f"PyTorch ({source})", unsupported)
    specs = _user_inputs(ep, source, overrides)
    try:
        mod = from_exported_program(ep, keep_params_as_input=False, run_ep_decomposition=False,
                                    custom_convert_map=custom_convert_map())
    except Exception as err:
        raise ModelError(f"{source}: torch import failed: {type(err).__name__}: {err}") from err
    mod = _bind_symbolic(mod, specs)
    ret = mod["main"].ret_ty
    n_out = len(ret.fields) if hasattr(ret, "fields") else 1
    if reference is None:
        with _quiet_torch_internals():
            module = ep.module()
        reference = _torch_reference(module)
    return ImportedModel(mod, specs, [f"output{i}" for i in range(n_out)], "torch", source, reference)


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
                  source: str | None = None) -> ImportedModel:
    """Export an ``nn.Module`` with ``example_inputs`` (re-made at override shapes) and import it."""
    import torch

    source = source or f"nn.Module {type(module).__name__}"
    module = module.eval()
    if overrides:
        sig = [p for p in _forward_params(module)][: len(example_inputs)]
        check_override_names(overrides, sig, source)
        new = []
        for name, ex in zip(sig, example_inputs):
            ov = overrides.get(name)
            if ov is None:
                new.append(ex)
            elif len(ov.shape) != ex.dim():
                raise InputSpecError(f"{source}: --input {name} rank {len(ov.shape)} != {ex.dim()}")
            else:
                new.append(_random_like(ex, ov.shape))
        example_inputs = tuple(new)
    try:
        with _quiet_torch_internals():
            ep = torch.export.export(module, example_inputs)
    except Exception as err:
        raise ModelError(f"{source}: torch.export failed: {type(err).__name__}: {err}") from err
    return import_exported(ep, {}, source, reference=_torch_reference(module))


def _forward_params(module) -> list[str]:
    import inspect

    return [p for p in inspect.signature(module.forward).parameters if p != "self"]


def _random_like(ex, shape):
    import torch

    if ex.dtype.is_floating_point:
        return torch.randn(shape, dtype=ex.dtype)
    return torch.randint(0, 2, shape, dtype=ex.dtype)


def import_pt2(path: str, overrides: dict[str, InputOverride]) -> ImportedModel:
    """Import a ``.pt2`` file written by ``torch.export.save``."""
    import torch

    if not os.path.isfile(path):
        raise ModelError(f"PyTorch program {path!r} does not exist")
    try:
        with _quiet_torch_internals():
            ep = torch.export.load(path)
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        raise ModelError(f"{path}: not a readable torch.export .pt2 file ({why})") from err
    return import_exported(ep, overrides, path)


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


def import_factory(spec: str, overrides: dict[str, InputOverride]) -> ImportedModel:
    """Import the module that ``package.module:factory`` builds."""
    module, example_inputs = load_factory(spec)
    return import_module(module, tuple(example_inputs), overrides, source=spec)


__all__ = ["import_exported", "import_factory", "import_module", "import_pt2", "load_factory",
           "scan_unsupported"]


