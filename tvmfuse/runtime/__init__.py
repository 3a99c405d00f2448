"""Load an exported tvmfuse library and call it. Needs only the TVM runtime.

Imports nothing from the frontend, passes, schedules or build code, so a library loads where only
``libtvm_runtime`` is installed (``TVM_USE_RUNTIME_LIB=1``).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

from ..errors import DeviceError, InputError, LibraryError
from ..targets import get_target
from .lm import LM_FORMAT, LanguageModel
from .tensor_parallel import DEFAULT_TIMEOUT_S, DistributedLanguageModel, rank_devices
from .weights import load_weights

METADATA_SYMBOL = "tvmfuse_metadata"


def _ensure_cuda_runtime() -> None:
    """Runtime-only TVM does not load its CUDA device API by itself: load it (RTLD_GLOBAL)."""
    import tvm

    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    lib_dir = Path(tvm.__file__).parent / "lib"
    candidates = [lib_dir / "libtvm_runtime_cuda.so"]
    for cand in candidates:
        if cand.exists():
            try:
                ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            except OSError as err:
                raise DeviceError(f"cannot load TVM's CUDA runtime {cand}: {err}") from err
            return
    raise DeviceError(f"TVM's CUDA runtime (libtvm_runtime_cuda.so) not found in {lib_dir}")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata a tvmfuse export embedded (signature, target, versions)."""
    _check_file(Path(path))
    try:
        # absolute: dlopen looks a bare name ("model.so") up on the library path, not in the cwd
        lib = ctypes.CDLL(os.path.abspath(path), mode=ctypes.RTLD_LOCAL | getattr(os, "RTLD_LAZY", 1))
        raw = ctypes.c_char_p(ctypes.addressof(ctypes.c_char.in_dll(lib, METADATA_SYMBOL))).value
    except (OSError, ValueError) as err:
        raise LibraryError(f"{path}: no tvmfuse metadata ({err}); not a tvmfuse library?") from err
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LibraryError(f"{path}: tvmfuse metadata is corrupt ({err})") from err


def _check_file(path: Path) -> None:
    """Validate the ELF64 layout before dlopen: a truncated file would SIGBUS on first touch."""
    if not path.is_file():
        raise LibraryError(f"library {path} does not exist")
    data = path.read_bytes()
    size = len(data)

    def bad(why: str) -> LibraryError:
        return LibraryError(f"{path} is not a valid shared library ({why}): corrupt or wrong file")

    if size < 64 or data[:4] != b"\x7fELF":
        raise bad("bad ELF header")
    if data[4] != 2 or data[5] != 1:
        raise bad("not a 64-bit little-endian ELF")
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 0x36)
    if e_phentsize < 56 or e_phnum == 0 or e_phoff + e_phnum * e_phentsize > size:
        raise bad("program headers missing or truncated")
    if e_shoff + e_shnum * e_shentsize > size:
        raise bad(f"section headers end past the file's {size} bytes (truncated)")
    kinds = set()
    for i in range(e_phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, e_phoff + i * e_phentsize)
        kinds.add(p_type)
        if p_type == 1 and p_offset + p_filesz > size:
            raise bad(f"segment {i} ends past the file's {size} bytes (truncated)")
    if not {1, 2} <= kinds:  # PT_LOAD and PT_DYNAMIC
        raise bad("no loadable dynamic segments")


def _cuda_device(index: int, path: Path, target: str):
    """TVM's CUDA device ``index``; DeviceError when TVM's CUDA runtime or the GPU is absent."""
    import tvm

    _ensure_cuda_runtime()
    dev = tvm.cuda(index)
    if not dev.exist:
        raise DeviceError(f"no CUDA device {index} is visible (library {path} targets {target})")
    return dev


def _compute_capability(dev) -> str:
    """The GPU's compute capability as ``"major.minor"`` (``"9.0"`` on an H100/H200)."""
    return dev.compute_version


def _device(kind: str, meta: dict[str, Any], path: Path):
    import tvm

    target = meta["target"]
    if kind == "cpu":
        if target != "cpu":
            raise DeviceError(f"{path} was built for target {target}; it cannot run on device 'cpu'")
        return tvm.cpu(0)
    if not kind.startswith("cuda"):
        raise DeviceError(f"unknown device {kind!r}; use 'cuda', 'cuda:N' or 'cpu'")
    if target == "cpu":
        raise DeviceError(f"{path} was built for target cpu; load it with device='cpu'")
    index = int(kind.split(":")[1]) if ":" in kind else 0
    dev = _cuda_device(index, path, target)
    cc = _compute_capability(dev)
    if not get_target(target).can_run_on(cc):
        sass = ", ".join(meta.get("sass") or [target])
        raise DeviceError(
            f"{path} holds SASS for {sass} only (target {target}); GPU {index} "
            f"({dev.device_name}) is sm_{cc.replace('.', '')}. Rebuild with the matching --target."
        )
    return dev


def _open(path: Path, device: str):
    """(metadata, device, module, VirtualMachine) of a tvmfuse library."""
    import tvm
    from tvm.runtime.vm import VirtualMachine

    _check_file(path)
    # Metadata and device first: a wrong-arch or missing GPU is named before TVM loads CUDA code.
    metadata = read_metadata(path)
    dev = _device(device, metadata, path)
    try:
        lib = tvm.runtime.load_module(str(path.absolute()))
    except Exception as err:  # TVM raises several error kinds for broken files
        raise LibraryError(f"cannot load {path}: {type(err).__name__}: {err}") from err
    try:
        vm = VirtualMachine(lib, dev)
    except Exception as err:
        raise LibraryError(f"cannot start {path} on {device}: {err}") from err
    return metadata, dev, lib, vm


class CompiledModel:
    """A loaded tvmfuse library: ``model(*inputs)`` runs one forward pass.

    Inputs are torch tensors (passed zero-copy through DLPack) or numpy arrays; outputs come
    back as the same kind: one tensor, or a tuple for several outputs. ``weights``: the device
    tensors of an external-weights library (``<name>.safetensors``), in parameter order.

    Thread-safe: calls from several threads are serialised. TVM's relax ``VirtualMachine`` keeps
    its frames, registers and memory pool in the VM object, and two threads in one VM crash it
    (seen as a segfault in ``StorageObj::AllocTensor``); a VM per thread would copy the weights
    to the device once per thread.
    """

    def __init__(self, path: str | os.PathLike, device: str = "cuda") -> None:
        self.path = Path(path)
        self.metadata, self.device, self.lib, self.vm = _open(self.path, device)
        # External weights (<name>.safetensors): checked, mapped and uploaded once; every call
        # passes them after the inputs. Empty for a library that embeds its weights.
        self.weights = load_weights(self.path, self.metadata, self.device)
        self._main = self.vm["main"]
        self._lock = threading.Lock()  # one call in the VM at a time (see the class docstring)
        self.inputs = self.metadata["inputs"]
        self.output_names = [o["name"] for o in self.metadata["outputs"]]
        # The per-call fast path compares against these (no string building, no imports).
        self._names = [i["name"] for i in self.inputs]
        self._shapes = [tuple(i["shape"]) for i in self.inputs]
        # Symbolic dims: each symbol's inclusive range ("dynamic": {"S": [1, 4096]} in the metadata).
        self.dynamic = {k: tuple(v) for k, v in self.metadata.get("dynamic", {}).items()}
        self._torch_dtypes = _torch_dtypes([i["dtype"] for i in self.inputs])
        self._torch_device = self._torch = self._torch_tensor = None
        if self._torch_dtypes is not None:
            import torch

            self._torch, self._torch_tensor = torch, torch.Tensor

            kind = "cpu" if self.device.dlpack_device_type() == 1 else "cuda"
            self._torch_device = torch.device(kind, self.device.index if kind == "cuda" else None)

    def __repr__(self) -> str:
        sig = ", ".join(f"{i['name']}: {i['dtype']}{i['shape']}" for i in self.inputs)
        return f"CompiledModel({self.path.name}, target={self.metadata['target']}, ({sig}))"

    def _check_shapes(self, shapes: list[tuple[int, ...]]) -> None:
        """Static dims equal, each symbol in its range and one value across inputs, else InputError."""
        seen: dict[str, tuple[int, str]] = {}
        for position, (spec, got) in enumerate(zip(self.inputs, shapes)):
            want = self._shapes[position]
            where = f"input {position} {spec['name']!r}"
            if len(got) != len(want):
                raise InputError(f"{where}: expected shape {list(want)}, got {list(got)}")
            for axis, (w, g) in enumerate(zip(want, got)):
                if isinstance(w, int):
                    if w != g:
                        raise InputError(f"{where}: expected shape {list(want)}, got {list(got)}")
                    continue
                lo, hi = self.dynamic[w]
                if not lo <= g <= hi:
                    raise InputError(f"{where}: dim {axis} ({w}) is {g}, outside {w}'s range "
                                     f"{lo}..{hi} (shape {list(want)}, got {list(got)})")
                first = seen.setdefault(w, (g, where))
                if first[0] != g:
                    raise InputError(f"{where}: dim {axis} ({w}) is {g}, but {first[1]} has "
                                     f"{w} = {first[0]}; a symbol is one length in every input")

    def _convert(self, value: Any, spec: dict[str, Any], position: int):
        import numpy as np
        import tvm

        name, shape, dtype = spec["name"], tuple(spec["shape"]), spec["dtype"]
        where = f"input {position} {name!r}"
        if hasattr(value, "__dlpack__") and type(value).__module__.startswith("torch"):
            got_dtype = str(value.dtype).replace("torch.", "")
            if got_dtype != dtype:
                raise InputError(f"{where}: expected dtype {dtype}, got {got_dtype}")
            if not self.dynamic and tuple(value.shape) != shape:
                raise InputError(f"{where}: expected shape {list(shape)}, got {list(value.shape)}")
            want = "cpu" if self.device.dlpack_device_type() == 1 else "cuda"
            if value.device.type != want or (
                want == "cuda" and value.device.index != self.device.index
            ):
                raise InputError(
                    f"{where}: tensor is on {value.device}, the library runs on "
                    f"{want}:{self.device.index}"
                )
            return tvm.runtime.from_dlpack(value.contiguous()), "torch"
        if isinstance(value, np.generic):  # a numpy scalar: the 0-d array it stands for
            value = np.asarray(value)
        if isinstance(value, np.ndarray):
            if str(value.dtype) != dtype:
                raise InputError(f"{where}: expected dtype {dtype}, got {value.dtype}")
            if not self.dynamic and value.shape != shape:
                raise InputError(f"{where}: expected shape {list(shape)}, got {list(value.shape)}")
            # np.ascontiguousarray would make a 0-d array 1-d; np.require keeps the rank
            return tvm.runtime.tensor(np.require(value, requirements="C"), self.device), "numpy"
        raise InputError(f"{where}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")

    def _fast_torch(self, args: tuple) -> bool:
        """Positional, contiguous torch inputs that match the signature exactly (static shapes)."""
        if self._torch_dtypes is None or len(args) != len(self._shapes) or self.dynamic:
            return False
        tensor, device = self._torch_tensor, self._torch_device
        for value, shape, dtype in zip(args, self._shapes, self._torch_dtypes):
            if (type(value) is not tensor or value.dtype is not dtype or value.shape != shape
                    or value.device != device or not value.is_contiguous()):
                return False
        return True

    def _run(self, args: Any):
        """``main`` on ``args`` (and the weights). A run-time check compiled into the model (a
        shape-like input's value: distinct in-range axes, a reshape target's element count, …)
        that fails becomes an :class:`InputError`; its symbols name the node and the input."""
        try:
            with self._lock:
                return self._main(*args, *self.weights)
        except RuntimeError as err:
            text = str(err)
            if "ErrorContext(match_cast" not in text:
                raise
            where = text[text.index("ErrorContext(match_cast"):].splitlines()[0]
            raise InputError("an input's value is not one the model allows (a run-time check of a "
                             f"shape-like input failed): {where}") from err

    def __call__(self, *args: Any, **kwargs: Any):
        if not kwargs and self._fast_torch(args):
            # tvm-ffi takes torch tensors through DLPack without a copy and hands back torch
            # tensors; a one-output library returns the tensor itself (UnwrapSingleOutput).
            out = self._run(args)
            if type(out) is self._torch_tensor:
                return out
            result = tuple(o if isinstance(o, self._torch_tensor) else self._torch.from_dlpack(o)
                           for o in ([out] if hasattr(out, "shape") else out))
            return result[0] if len(result) == 1 else result
        names = self._names
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise InputError(f"unknown input name(s) {unknown}; the library's inputs are {names}")
        values = list(args) + [None] * (len(names) - len(args))
        if len(args) > len(names):
            raise InputError(f"{len(args)} inputs given, the library takes {len(names)}: {names}")
        for k, v in kwargs.items():
            i = names.index(k)
            if values[i] is not None:
                raise InputError(f"input {k!r} given twice")
            values[i] = v
        missing = [n for n, v in zip(names, values) if v is None]
        if missing:
            raise InputError(f"missing input(s) {missing}; the library takes {names}")
        converted = [self._convert(v, s, i) for i, (v, s) in enumerate(zip(values, self.inputs))]
        if self.dynamic:
            self._check_shapes([tuple(t.shape) for t, _ in converted])
        kinds = {k for _, k in converted}
        out = self._run([t for t, _ in converted])
        outs = list(out) if not hasattr(out, "shape") else [out]
        if "torch" in kinds:
            import torch

            result = [torch.from_dlpack(o) for o in outs]
        else:
            result = [o.numpy() for o in outs]
        return result[0] if len(result) == 1 else tuple(result)


def _torch_dtypes(dtypes: list[str]) -> list | None:
    """torch dtypes for ``dtypes``; None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return [getattr(torch, d, None) for d in dtypes]


def load(path: str | os.PathLike, device: str = "cuda", devices: list[int] | None = None,
         timeout: float | None = None) -> CompiledModel | LanguageModel | DistributedLanguageModel:
    """Load a library written by ``tvmfuse compile`` / ``Library.export``; returns a callable.

    A ``compile_lm`` library comes back as a :class:`~tvmfuse.runtime.lm.LanguageModel`
    (``generate``); a tensor-parallel one (``tensor_parallel=N``) as a
    :class:`~tvmfuse.runtime.tensor_parallel.DistributedLanguageModel`, N worker processes on
    ``devices`` (GPU indices, default 0..N-1; on ``device="cpu"`` N processes). ``timeout``: seconds
    a rank may take per call (default ``TVMFUSE_TP_TIMEOUT`` or 600)."""
    meta = read_metadata(path)
    world = int(meta.get("tensor_parallel", 1))
    if meta.get("format") == LM_FORMAT and world > 1:
        kind = "cpu" if device == "cpu" else "cuda"
        if (kind == "cpu") != (meta["target"] == "cpu"):
            _device(device, meta, Path(path))  # raises the usual target/device error
        ranks = rank_devices(kind, world, devices)
        return DistributedLanguageModel(path, meta, ranks, timeout or DEFAULT_TIMEOUT_S)
    if devices is not None and list(devices) != [int(device.split(":")[1]) if ":" in device else 0]:
        raise DeviceError(f"{path} runs on one device (it is not tensor-parallel); got devices={devices}")
    if meta.get("format") == LM_FORMAT:
        meta, dev, _, vm = _open(Path(path), device)
        return LanguageModel(vm, dev, meta, Path(path), load_weights(Path(path), meta, dev))
    return CompiledModel(path, device)


__all__ = ["CompiledModel", "DistributedLanguageModel", "LanguageModel", "load", "load_weights",
           "read_metadata"]
