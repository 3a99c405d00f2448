"""Write a library's weights as ``<name>.safetensors`` beside its ``.so``.

The tensors are streamed one at a time (a CPU view through DLPack where numpy has the dtype), so
exporting a 13.5 GB model needs no second copy of it in memory. The file is standard safetensors
(``safetensors.safe_open`` reads it); :mod:`tvmfuse.runtime.weights` reads it back with numpy.
Returns the metadata entry the loader checks (file, size, fingerprint, parameter order).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from ..errors import CompileError
from ..passes.lift_weights import host_array
from ..runtime.weights import FORMAT, SAFETENSORS_DTYPES, fingerprint, tensor_sample

Weights = list[tuple[str, tvm.runtime.Tensor]]


def _header(weights: Weights) -> bytes:
    """The JSON header, space-padded to a multiple of 8 bytes (as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, tensor in weights:
        dtype = str(tensor.dtype)
        if dtype not in SAFETENSORS_DTYPES:
            raise CompileError(f"weight {name!r} has dtype {dtype}, which safetensors cannot hold")
        nbytes = int(np.prod(tensor.shape, dtype=np.int64)) * tvm.DataType(dtype).itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(d) for d in tensor.shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_weights(weights: Weights, path: str | os.PathLike, name: str | None = None) -> dict[str, Any]:
    """Write ``weights`` (``[(name, CPU tensor)]`` in parameter order) to ``path``; returns the
    library's metadata entry, which names the file ``name`` (default: ``path``'s name)."""
    path = Path(path)
    header = _header(weights)
    samples = []
    try:
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for _, tensor in weights:
                data = np.ascontiguousarray(host_array(tensor)).reshape(-1).view(np.uint8)
                f.write(memoryview(data))
                samples.append(tensor_sample(data))
    except OSError as err:
        raise CompileError(f"writing weights file {path} failed: {err}") from err
    return {"file": name or path.name, "size": path.stat().st_size,
            "fingerprint": fingerprint(header, samples),
            "params": [{"name": name, "shape": [int(d) for d in t.shape], "dtype": str(t.dtype)}
                       for name, t in weights]}
