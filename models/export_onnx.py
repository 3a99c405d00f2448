"""Export the example models to ONNX.

    python -m models.export_onnx mlp_block -o mlp_block.onnx --batch 2 --seq 16 --hidden 64
    python -m models.export_onnx decoder_layer -o decoder.onnx --n-heads 4 --n-kv-heads 2

``export_onnx`` uses the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``), which
torch 2.13 still ships and which keeps the graph as written (Trilu/Where for the causal mask,
Cos/Sin for RoPE). Where that exporter is missing or fails it falls back to the torch.export-based
exporter (``dynamo=True``, needs onnxscript), which constant-folds more and may raise the opset to
its own minimum (18 in torch 2.13).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

MODELS = ("mlp_block", "decoder_layer")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _export_torchscript(module, example_inputs, path, input_names, output_names, opset, dynamic):
    dynamic_axes = {name: {0: "batch"} for name in (*input_names, *output_names)} if dynamic else None
    with warnings.catch_warnings():
        # "You are using the legacy TorchScript-based ONNX export": chosen on purpose, see above.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module,
            tuple(example_inputs),
            os.fspath(path),
            input_names=list(input_names),
            output_names=list(output_names),
            opset_version=opset,
            dynamic_axes=dynamic_axes,
            dynamo=False,
        )


def _export_dynamo(module, example_inputs, path, input_names, output_names, opset, dynamic):
    dynamic_shapes = None
    if dynamic:
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} for _ in example_inputs)
    program = torch.onnx.export(
        module,
        tuple(example_inputs),
        input_names=list(input_names),
        output_names=list(output_names),
        opset_version=opset,
        dynamic_shapes=dynamic_shapes,
        dynamo=True,
    )
    # One self-contained file (the example models are far below protobuf's 2 GiB limit).
    program.save(os.fspath(path), external_data=False)


def export_onnx(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    path: str | os.PathLike,
    input_names: Sequence[str] = ("x",),
    output_names: Sequence[str] = ("y",),
    opset: int = 17,
    *,
    dynamic_batch: bool = False,
    dynamo: bool | None = None,
) -> Path:
    """Write ``module`` as an ONNX model to ``path`` and check it with ``onnx.checker``.

    ``dynamo``: None tries the TorchScript exporter first and falls back to the dynamo exporter;
    False/True forces one of them. ``dynamic_batch`` makes dim 0 of every input and output the
    symbolic dimension ``batch``.
    """
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    args = (module, example_inputs, path, input_names, output_names, opset, dynamic_batch)
    with torch.no_grad():
        if dynamo is None:
            try:
                _export_torchscript(*args)
            except Exception as err:  # exporter missing (future torch) or unable to trace
                warnings.warn(
                    f"TorchScript ONNX export failed ({type(err).__name__}: {err}); "
                    "falling back to the dynamo exporter",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _export_dynamo(*args)
        elif dynamo:
            _export_dynamo(*args)
        else:
            _export_torchscript(*args)
    onnx.checker.check_model(os.fspath(path))
    if dynamic_batch:
        static = [
            i.name for i in onnx.load(os.fspath(path), load_external_data=False).graph.input
            if i.type.tensor_type.shape.dim and not i.type.tensor_type.shape.dim[0].dim_param
        ]
        if static:
            # torch.export specialises size-1 dims, so the dynamo exporter drops Dim("batch").
            raise ValueError(
                f"{path}: inputs {static} kept a static batch dim; export with a batch size >= 2"
            )
    return path


def build_model(name: str, **kwargs) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``models.<name>.build(**kwargs)``; keyword arguments the builder lacks are an error."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    build = importlib.import_module(f"models.{name}").build
    params = inspect.signature(build).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise ValueError(
            f"model {name} does not take {', '.join('--' + k.replace('_', '-') for k in unknown)}"
        )
    return build(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.export_onnx", description="Export an example model to ONNX."
    )
    parser.add_argument("name", choices=MODELS)
    parser.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    for flag in ("batch", "seq", "hidden", "ffn", "n-heads", "n-kv-heads", "seed"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument(
        "--dynamic-batch", action="store_true", help="make dim 0 the symbolic dimension 'batch'"
    )
    parser.add_argument(
        "--exporter", choices=("auto", "torchscript", "dynamo"), default="auto",
        help="auto: TorchScript exporter, dynamo exporter if that fails",
    )
    args = parser.parse_args(argv)

    kwargs = {
        key: getattr(args, key)
        for key in ("batch", "seq", "hidden", "ffn", "n_heads", "n_kv_heads", "seed")
        if getattr(args, key) is not None
    }
    if args.dtype:
        kwargs["dtype"] = _DTYPES[args.dtype]
    try:
        module, example_inputs = build_model(args.name, **kwargs)
    except ValueError as err:
        parser.error(str(err))
    dynamo = {"auto": None, "torchscript": False, "dynamo": True}[args.exporter]
    path = export_onnx(
        module, example_inputs, args.output, opset=args.opset,
        dynamic_batch=args.dynamic_batch, dynamo=dynamo,
    )
    shapes = ", ".join(f"x{list(t.shape)}" for t in example_inputs)
    print(f"wrote {path} ({args.name}, {shapes})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
