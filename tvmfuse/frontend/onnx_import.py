"""ONNX → Relax through ``tvm.relax.frontend.onnx.from_onnx``."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InputSpecError, ModelError, TvmfuseError, UnsupportedOpError
from .onnx_fixes import OVERRIDES, converters, node_refusals
from .onnx_nodes import UNROLLED
from .spec import ImportedModel, InputOverride, Ranges, TensorSpec, check_override_names, check_symbols
from .symbolic import bound_symbols, symbol_vars

# ONNX TensorProto elem_type -> dtype name: every element type numpy and TVM both hold
_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32",
                7: "int64", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64",
                16: "bfloat16"}


def load_onnx(model: Any, source: str):
    """``model`` as an ``onnx.ModelProto`` (a path is read; a proto passes through); unreadable or
    empty files raise :class:`~tvmfuse.errors.ModelError` naming ``source``."""
    import onnx
    from google.protobuf.message import DecodeError

    if not isinstance(model, (str, os.PathLike)):
        return model
    if not os.path.isfile(model):
        raise ModelError(f"ONNX model {source!r} does not exist")
    try:
        proto = onnx.load(os.fspath(model))
    except onnx.checker.ValidationError as err:  # external data: a tensor's data file is missing
        raise ModelError(f"{source}: cannot read the model's external data: {err}") from err
    except (DecodeError, ValueError, RuntimeError, OSError) as err:
        raise ModelError(f"{source}: not a readable ONNX model ({type(err).__name__}: {err})") from err
    if not proto.graph.node and not proto.graph.output:
        raise ModelError(f"{source}: ONNX file holds an empty graph (corrupt or not ONNX)")
    return proto


def check_opset(proto, source: str) -> None:
    """Refuse a default-domain opset newer than the installed onnx defines: what its operators
    mean there is unknown, so converting them with an older opset's semantics could be wrong."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > newest:
            raise ModelError(
                f"{source}: the model imports ONNX opset {imp.version}; the installed onnx "
                f"{onnx.__version__} knows opsets up to {newest} (re-export with opset <= {newest} "
                "or upgrade onnx)"
            )


def check_defined_inputs(graph, source: str, outer: frozenset[str] = frozenset()) -> None:
    """Every node input is a graph input, an initializer, an earlier node's output or (in a
    subgraph) a name of an enclosing graph; otherwise name the node and the missing tensor."""
    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    known |= {t.values.name for t in graph.sparse_initializer}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in known:
                raise ModelError(
                    f"{source}: node {node.name or f'#{i}'!r} (op {node.op_type}) reads tensor "
                    f"{name!r}, which is no graph input, initializer or earlier node's output "
                    "(a missing initializer?)"
                )
        for attr in node.attribute:
            for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
                check_defined_inputs(sub, source, frozenset(known))
        known.update(node.output)


def output_refusals(graph) -> list[tuple[str, str]]:
    """``(node, what)`` for each graph output tvmfuse cannot return: a sequence, optional or map
    (0.27 flattens a sequence into separate tensors: wrong arity and shapes), or a tensor of an
    element type outside :data:`_ONNX_DTYPES` (fp8, int4, ...). ``node`` is its producer."""
    producer = {out: node for node in graph.node for out in node.output}
    found = []
    for out in graph.output:
        kind = out.type.WhichOneof("value")
        if kind == "tensor_type" and out.type.tensor_type.elem_type in _ONNX_DTYPES:
            continue
        what = (f"element type {_elem_name(out.type.tensor_type.elem_type)}"
                if kind == "tensor_type" else kind.removesuffix("_type"))
        node = producer.get(out.name)
        label = (node.name or f"<output {out.name}>") if node is not None else out.name
        op = node.op_type if node is not None else "graph output"
        found.append((label, f"{op} output {out.name!r} of {what}, which tvmfuse cannot return"))
    return found


def scan_unsupported(graph) -> list[tuple[str, str]]:
    """Every node (subgraphs included) whose op has no Relax converter, as (node, op_type), and
    every use of an op that its converter refuses (an ONNX Attention attribute, say)."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    supported = set(_get_convert_map()) | set(OVERRIDES) | {"Constant", "If"} | UNROLLED
    found: list[tuple[str, str]] = []

    def visit(g, prefix: str) -> None:
        found.extend(node_refusals(g))
        for i, node in enumerate(g.node):
            name = node.name or f"{prefix}#{i}"
            if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
                op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
                found.append((name, op))
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    visit(attr.g, f"{name}/{attr.name}")

    visit(graph, "node")
    return found + output_refusals(graph)


def fold_scalar_constant_of_shape(proto) -> int:
    """ConstantOfShape with a constant empty shape → a scalar Constant node (in place).

    TVM 0.27's converter only folds rank-1 shapes; a rank-0 result (transformers' ``and_masks``
    writes ``new_ones((), dtype=bool)``) becomes ``broadcast_to(const (1,), ())`` and fails type
    inference. Returns how many nodes were rewritten.
    """
    from onnx import helper, numpy_helper

    graph = proto.graph
    empty = {t.name for t in graph.initializer if numpy_helper.to_array(t).size == 0 and t.dims == [0]}
    empty |= {n.output[0] for n in graph.node if n.op_type == "Constant" and n.attribute
              and n.attribute[0].HasField("t") and list(n.attribute[0].t.dims) == [0]}
    count = 0
    for i, node in enumerate(graph.node):
        if node.op_type != "ConstantOfShape" or not node.input or node.input[0] not in empty:
            continue
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        scalar = numpy_helper.to_array(value).reshape(()) if value is not None else None
        if scalar is None:
            import numpy as np

            scalar = np.zeros((), np.float32)  # the ONNX default value
        new = helper.make_node("Constant", [], list(node.output), name=node.name,
                               value=numpy_helper.from_array(scalar))
        graph.node.remove(node)
        graph.node.insert(i, new)
        count += 1
    return count


def _elem_name(elem_type: int) -> str:
    from onnx import TensorProto

    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"elem_type {elem_type}"


def _input_specs(proto, overrides: dict[str, InputOverride], dynamic: Ranges,
                 source: str) -> list[TensorSpec]:
    """Each graph input's shape: the model's dims, ``--input`` overrides (ints or symbols) and the
    ``dim_param``s that ``dynamic`` names (kept as symbols)."""
    init_names = {t.name for t in proto.graph.initializer}
    graph_inputs = [i for i in proto.graph.input if i.name not in init_names]
    check_override_names(overrides, [i.name for i in graph_inputs], source)
    specs = []
    for inp in graph_inputs:
        ttype = inp.type.tensor_type
        dtype = _ONNX_DTYPES.get(ttype.elem_type)
        if dtype is None:
            raise ModelError(f"{source}: input {inp.name!r} has element type "
                             f"{_elem_name(ttype.elem_type)}, which tvmfuse cannot take as input")
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
                for d in ttype.shape.dim]
        if inp.name in overrides:
            ov = overrides[inp.name]
            if len(ov.shape) != len(dims):
                raise InputSpecError(
                    f"{source}: --input {inp.name} has rank {len(ov.shape)}, the model input has "
                    f"rank {len(dims)} (shape {dims})"
                )
            for d, v in zip(dims, ov.shape):
                if isinstance(d, int) and d != v:
                    raise InputSpecError(
                        f"{source}: --input {inp.name} shape {list(ov.shape)} contradicts the "
                        f"model's static shape {dims}"
                    )
            specs.append(TensorSpec(inp.name, ov.shape, ov.dtype or dtype))
            continue
        unnamed = [d for d in dims if isinstance(d, str) and d not in dynamic]
        if unnamed:
            raise InputSpecError(
                f"{source}: input {inp.name!r} has dynamic dimension(s) {unnamed} (shape {dims}); "
                f"fix them with --input {inp.name}:" + "x".join(
                    str(d) if isinstance(d, int) else "N" for d in dims)
                + " or keep them symbolic with --dynamic NAME=LO..HI (NAME: the dim_param or a "
                "symbol named in --input)"
            )
        specs.append(TensorSpec(inp.name, tuple(dims), dtype))
    check_symbols(specs, dynamic, source)
    return specs


def _ort_reference(proto):
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    names = None

    def run(*arrays):
        nonlocal names
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        return sess.run(None, dict(zip(names, arrays)))

    return run


def import_onnx(model: Any, overrides: dict[str, InputOverride],
                dynamic: Ranges | None = None, source: str | None = None) -> ImportedModel:
    """Import an ONNX file or ModelProto; shapes come from the model or ``overrides``; the symbols
    that ``dynamic`` names (``dim_param``s or symbols of ``overrides``) stay symbolic. ``source``
    names the model in errors (default: the path)."""
    from tvm.relax.frontend.onnx import from_onnx

    if source is None:
        source = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "<onnx.ModelProto>"
    proto = load_onnx(model, source)
    check_opset(proto, source)
    check_defined_inputs(proto.graph, source)
    unsupported = scan_unsupported(proto.graph)
    if unsupported:
        raise UnsupportedOpError(f"ONNX ({source})", unsupported)
    dynamic = dynamic or {}
    specs = _input_specs(proto, overrides, dynamic, source)
    syms = symbol_vars(dynamic)
    fold_scalar_constant_of_shape(proto)
    try:
        with converters():
            mod = from_onnx(
                proto,
                shape_dict={s.name: [syms.get(d, d) for d in s.shape] for s in specs},
                dtype_dict={s.name: s.dtype for s in specs},
                keep_params_in_input=False,
            )
    except TvmfuseError:
        raise
    except Exception as err:  # the importer raises many kinds; name the model
        raise ModelError(f"{source}: ONNX import failed: {type(err).__name__}: {err}") from err
    outputs = [o.name for o in proto.graph.output]
    mod = bound_symbols(mod, dynamic) if dynamic else mod
    return ImportedModel(mod, specs, outputs, "onnx", source, _ort_reference(proto), dynamic)
