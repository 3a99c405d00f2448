"""Import a cache-less causal LM (``ids (B, S) → logits (B, S, V)``) with symbolic B and S.

torch: ``torch.export`` with ``dynamic_shapes`` (B in 1..max_batch, S in 2..max_seq; an
``nn.Module`` whose output is a transformers ``ModelOutput`` or a tuple gives its first field,
``use_cache=False`` where ``forward`` takes it) and TVM's ``from_exported_program``; ``.pt2``: the
saved program with its own symbols; ONNX: tvmfuse's ONNX import (with its converter fixes for
shape values) with the ids input's axes named B (1..max_batch; a static batch must equal
max_batch) and S (2..max_seq), whatever the file's ``dim_param``s. The result is
``main(ids: (B, S)) → (logits,)``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import tvm
from tvm import relax

from ..errors import ModelError, UnsupportedOpError
from ..frontend.onnx_import import import_onnx, load_onnx
from ..frontend.spec import InputOverride
from ..frontend.torch_complex import lower_complex
from ..frontend.torch_import import (
    converters,
    decompose,
    export_with_dims,
    failed_at,
    quiet_torch_internals,
    scan_unsupported,
)


def _logits_module(model):
    import torch

    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = self.model(ids, **kwargs)
            if hasattr(out, "logits"):
                return out.logits
            return out[0] if isinstance(out, (tuple, list)) else out

    return Logits().eval()


def _from_exported(ep, source: str) -> tvm.IRModule:
    from tvm.relax.frontend.torch import from_exported_program

    ep = decompose(ep, source)
    # Relax has no complex dtype: complex tensors (Meta's / DeepSeek's RoPE) as (real, imag) pairs
    ep = lower_complex(ep, source)
    unsupported = scan_unsupported(ep)
    if unsupported:
        raise UnsupportedOpError(f"PyTorch ({source})", unsupported)
    grouped = [n.name for n in ep.graph.nodes if "grouped_mm" in str(n.target)]
    if grouped:  # tvmfuse.compile takes them (frontend/torch_moe.py); positions could not follow
        raise ModelError(f"{source}: compile_lm does not take transformers' grouped experts "
                         f"(nodes {grouped}: rows of all positions sorted by expert); build the "
                         "model with experts_implementation=\"batched_mm\" (config or "
                         "from_pretrained)")
    try:
        with quiet_torch_internals():
            return from_exported_program(ep, keep_params_as_input=False, run_ep_decomposition=False,
                                         custom_convert_map=converters())
    except Exception as err:
        raise ModelError(f"{source}: torch import failed{failed_at(err)}: {type(err).__name__}: "
                         f"{err}") from err


def _torch_module(model, max_seq: int, max_batch: int) -> tvm.IRModule:
    import torch
    from torch.export import Dim

    module = _logits_module(model.eval())
    ids = torch.randint(0, 2, (min(2, max_batch) if max_batch > 1 else 1, min(8, max_seq)))
    dims = {1: Dim("S", min=2, max=max_seq)}
    if max_batch > 1:
        dims[0] = Dim("B", min=1, max=max_batch)
    source = f"nn.Module {type(model).__name__}"
    try:
        ep = export_with_dims(module, (ids,), (dims,))
    except Exception as err:
        raise ModelError(f"{source}: torch.export with a symbolic sequence length failed: "
                         f"{type(err).__name__}: {err}") from err
    return _from_exported(ep, source)


def _onnx_module(path: str, max_seq: int, max_batch: int) -> tvm.IRModule:
    """The ONNX file with its token-id axes named ``B`` and ``S`` (whatever its ``dim_param``s)."""
    proto = load_onnx(path, path)
    inits = {t.name for t in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in inits]
    if len(inputs) != 1 or len(inputs[0].type.tensor_type.shape.dim) != 2:
        raise ModelError(f"compile_lm: {path} must have one input, token ids (batch, seq); got "
                         f"{[i.name for i in inputs]}")
    batch, seq = (d.dim_value if d.HasField("dim_value") else None
                  for d in inputs[0].type.tensor_type.shape.dim)
    if seq is not None:
        raise ModelError(f"compile_lm: {path}: input {inputs[0].name!r} has a static sequence length "
                         f"{seq}; export it with a dynamic sequence axis (dynamic_shapes / dynamic_axes)")
    if batch is not None and batch != max_batch:
        raise ModelError(f"compile_lm: {path}: input {inputs[0].name!r} has a static batch {batch}, "
                         f"not max_batch={max_batch}; export a dynamic batch axis or match it")
    dynamic = {"S": (2, max_seq)} | ({} if batch else {"B": (1, max_batch)})
    shape = (batch or "B", "S")
    return import_onnx(proto, {inputs[0].name: InputOverride(shape, "int64")}, dynamic, source=path).mod


def import_lm(model: Any, max_seq: int, max_batch: int) -> tvm.IRModule:
    """``main(ids (B, S)) → (logits,)`` with symbolic B and S (see module doc)."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if path.endswith(".onnx"):
            mod = _onnx_module(path, max_seq, max_batch)
        elif path.endswith(".pt2"):
            import torch

            mod = _from_exported(torch.export.load(path), path)
        else:
            raise ModelError(f"compile_lm: {path!r} is neither a .onnx nor a .pt2 file")
    else:
        mod = _torch_module(model, max_seq, max_batch)
    func = mod["main"]
    if len(func.params) != 1 or func.params[0].ty.ndim != 2:
        raise ModelError("compile_lm needs a model with one input, token ids (batch, seq); got "
                         f"{[str(p.ty) for p in func.params]}")
    return relax.transform.CanonicalizeBindings()(mod)
