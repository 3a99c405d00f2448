"""A library's weights file: safetensors beside the ``.so``, memory-mapped and uploaded once.

Layout (huggingface safetensors): ``<u64 n> <n bytes of JSON header> <data>``; the header maps each
tensor name to ``{"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}`` (offsets into
``data``) plus ``"__metadata__"``. The tensors are read with ``numpy.memmap`` (no copy of the file
into memory, bfloat16/float8 through ml_dtypes), so this needs numpy and the TVM runtime only.

The library's metadata ``"weights"`` entry (written by ``tvmfuse.build.weights``) names the file,
its size, a fingerprint and the parameters in the order ``main`` takes them after the inputs;
:func:`load_weights` checks all of them before anything reaches the device.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LibraryError

FORMAT = "tvmfuse-weights/1"
# TVM dtype → safetensors dtype
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16",
                      "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
_TVM_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors reference implementation's limit
_SAMPLE = 4096  # bytes from each end of every tensor that go into the fingerprint


def weights_path(library: str | Path, rank: int | None = None) -> Path:
    """``lm.so`` → ``lm.safetensors`` (beside it); rank ``i`` of a tensor-parallel library:
    ``lm.rank<i>.safetensors``."""
    return Path(library).with_suffix(".safetensors" if rank is None else f".rank{rank}.safetensors")


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy dtype of a TVM dtype name (ml_dtypes for bfloat16 / float8)."""
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))
    return np.dtype(dtype)


def fingerprint(header: bytes, samples: list[bytes]) -> str:
    """sha256 of the header and of each tensor's first and last ``_SAMPLE`` bytes: a check that
    reads kilobytes, not the whole file, and tells apart files of two exports."""
    h = hashlib.sha256(header)
    for sample in samples:
        h.update(sample)
    return h.hexdigest()


def tensor_sample(data: np.ndarray) -> bytes:
    """The bytes of one tensor that :func:`fingerprint` reads (``data``: its bytes as uint8)."""
    if data.size <= 2 * _SAMPLE:
        return data.tobytes()
    return data[:_SAMPLE].tobytes() + data[-_SAMPLE:].tobytes()


class WeightsFile:
    """A parsed safetensors header; ``array(name)`` maps one tensor read-only from the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise LibraryError(f"weights file {path} does not exist")
        self.size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise self.bad(f"{self.size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, self.size - 8):
                raise self.bad(f"header length {n} runs past the file's {self.size} bytes")
            self.header_bytes = f.read(n)
        try:
            header = json.loads(self.header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self.bad(f"header is not JSON ({err})") from err
        if not isinstance(header, dict):
            raise self.bad("header is not a JSON object")
        self.metadata = header.pop("__metadata__", {})
        self.data_start = 8 + n
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry)

    def bad(self, why: str) -> LibraryError:
        return LibraryError(f"weights file {self.path} is not a valid safetensors file ({why})")

    def _entry(self, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
        try:
            dtype = _TVM_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise self.bad(f"tensor {name!r}: malformed entry {entry!r}") from err
        if end - begin != int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize or begin < 0:
            raise self.bad(f"tensor {name!r}: offsets {begin}..{end} do not hold {dtype}{list(shape)}")
        if self.data_start + end > self.size:
            raise LibraryError(
                f"weights file {self.path} is truncated: tensor {name!r} ends at byte "
                f"{self.data_start + end}, the file has {self.size}")
        return dtype, shape, begin, end

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only memory map of the file."""
        dtype, shape, begin, _ = self.tensors[name]
        return np.memmap(self.path, dtype=numpy_dtype(dtype), mode="r", offset=self.data_start + begin,
                         shape=shape)

    def fingerprint(self) -> str:
        """:func:`fingerprint` of this file, tensors in the order of their offsets."""
        samples = []
        with self.path.open("rb") as f:
            for _, _, begin, end in sorted(self.tensors.values(), key=lambda t: t[2]):
                f.seek(self.data_start + begin)
                if end - begin <= 2 * _SAMPLE:
                    samples.append(f.read(end - begin))
                else:
                    head = f.read(_SAMPLE)
                    f.seek(self.data_start + end - _SAMPLE)
                    samples.append(head + f.read(_SAMPLE))
        return fingerprint(self.header_bytes, samples)


def check_weights(library: Path, entry: dict[str, Any], rank: int | None = None) -> WeightsFile:
    """The weights file the metadata ``entry`` describes, checked: present, every parameter there
    with its dtype and shape, the size and fingerprint of the export.

    Looked up beside the library as ``<library name>.safetensors`` (a renamed pair), else under
    the name export gave it (a renamed ``.so`` alone); ``rank``: a tensor-parallel rank's file."""
    candidates = list(dict.fromkeys([weights_path(library, rank), library.parent / entry["file"]]))
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise LibraryError(f"{library} keeps its weights in {' or '.join(map(str, candidates))}, "
                           f"which does not exist: copy the .safetensors file export wrote beside it")
    wf = WeightsFile(path)
    for param in entry["params"]:
        name, dtype, shape = param["name"], param["dtype"], tuple(param["shape"])
        if name not in wf.tensors:
            raise LibraryError(f"weights file {path} has no tensor {name!r} ({library} needs "
                               f"{len(entry['params'])} tensors; the file has {len(wf.tensors)})")
        got_dtype, got_shape, _, _ = wf.tensors[name]
        if (got_dtype, got_shape) != (dtype, shape):
            raise LibraryError(f"weights file {path}: tensor {name!r} is {got_dtype}{list(got_shape)}, "
                               f"{library} needs {dtype}{list(shape)}")
    if wf.size != entry["size"]:
        raise LibraryError(f"weights file {path} is {wf.size} bytes; {library} was exported with "
                           f"{entry['size']}: the file is from another export")
    if wf.fingerprint() != entry["fingerprint"]:
        raise LibraryError(f"weights file {path} does not belong to {library} (its contents differ "
                           "from the export's: the file is from another export)")
    return wf


def load_weights(library: str | Path, metadata: dict[str, Any], device, rank: int | None = None) -> list:
    """The library's weights on ``device`` (``tvm.runtime.Device``), in parameter order: what
    ``main`` (and every entry point) takes after the inputs. Empty for an embedded-weights library."""
    import tvm

    entry = metadata.get("weights")
    if not entry:
        return []
    wf = check_weights(Path(library), entry, rank)
    return [tvm.runtime.tensor(wf.array(p["name"]), device) for p in entry["params"]]


__all__ = ["FORMAT", "SAFETENSORS_DTYPES", "WeightsFile", "check_weights", "fingerprint", "load_weights",
           "numpy_dtype", "tensor_sample", "weights_path"]
