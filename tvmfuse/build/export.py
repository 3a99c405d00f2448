"""Export a Relax VM executable as one ``.so`` that runs under the TVM runtime alone.

Stock 0.27 built without a GPU driver serialises CUDA *source* (format ``cuda``) and JIT-compiles
it at load, which needs a compiler where the model runs. Here the import blob that
``export_library`` embeds is rewritten: each serialised CUDA module ``[fmt][fmap][code]`` gets
``fmt = "fatbin"`` and ``code`` = an nvcc-built fatbin (SASS for the target's archs). The runtime's
``ffi.Module.load_from_bytes.cuda`` then loads it with ``cuModuleLoadData``: no nvcc, no NVRTC.
A C symbol ``tvmfuse_metadata`` holds the signature, target and versions as JSON.

With external weights (``weights=``, from ``LiftWeights``) the tensors go to ``<name>.safetensors``
beside the ``.so`` (:mod:`tvmfuse.build.weights`) and the metadata's ``"weights"`` entry names it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CompileError
from ..runtime import METADATA_SYMBOL  # one name, defined where the loader reads it
from ..runtime.weights import weights_path
from ..targets import TargetSpec
from .nvcc import compile_fatbin
from .weights import Weights, write_weights


class BlobReader:
    """Little-endian reader of TVM's ``BytesOutStream`` encoding."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def u64_vec(self) -> list[int]:
        n = self.u64()
        values = list(struct.unpack_from(f"<{n}Q", self.data, self.pos))
        self.pos += 8 * n
        return values

    def skip(self, n: int) -> None:
        self.pos += n

    def raw(self) -> bytes:
        n = self.u64()
        value = self.data[self.pos : self.pos + n]
        if len(value) != n:
            raise CompileError("truncated module blob")
        self.pos += n
        return value


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def parse_cuda_payload(payload: bytes) -> tuple[str, bytes, bytes]:
    """Split a serialised CUDA module into (fmt, raw fmap bytes, code).

    fmap = <u64 n> { <str key> <str name> <u64 k> k*DLDataType(4B) <u64 m> m*<str tag>
    <u64 e> e*int32 }*  (tvm/support/serializer.h, runtime/metadata.h).
    """
    r = BlobReader(payload)
    fmt = r.raw().decode()
    fmap_start = r.pos
    for _ in range(r.u64()):
        r.raw()  # key
        r.raw()  # FunctionInfo.name
        r.skip(4 * r.u64())  # arg_types
        for _ in range(r.u64()):
            r.raw()  # launch_param_tags
        r.skip(4 * r.u64())  # arg_extra_tags
    fmap = payload[fmap_start : r.pos]
    code = r.raw()
    if r.pos != len(payload):
        raise CompileError("serialised CUDA module has trailing bytes: format changed?")
    return fmt, fmap, code


def rewrite_cuda_modules(blob: bytes, compile_source: Callable[[str], bytes]) -> tuple[bytes, int]:
    """Replace every CUDA-source module in an import blob by its fatbin.

    blob = <u64 nbytes> <u64 vec indptr> <u64 vec children> { <str kind> [<bytes payload>] }*
    cuda payload = <str fmt> <map fmap> <bytes code>. Returns (new blob, modules rewritten).
    """
    r = BlobReader(blob)
    nbytes = r.u64()
    if nbytes != len(blob) - 8:
        raise CompileError(f"module blob size mismatch ({nbytes} vs {len(blob) - 8})")
    start = r.pos
    indptr = r.u64_vec()
    r.u64_vec()
    out = bytearray(blob[start : r.pos])
    rewritten = 0
    for _ in range(len(indptr) - 1):
        kind = r.raw()
        out += _str(kind)
        if kind == b"_lib":
            continue
        payload = r.raw()
        if kind == b"cuda":
            fmt, fmap, code = parse_cuda_payload(payload)
            if fmt == "cuda":
                fatbin = compile_source(code.decode())
                payload = _str(b"fatbin") + fmap + _str(fatbin)
                rewritten += 1
        out += _str(payload)
    return struct.pack("<Q", len(out)) + bytes(out), rewritten


def count_cuda_modules(mod) -> int:
    """How many ``cuda`` modules ``mod`` (a runtime module) imports, directly or not."""
    return sum(int(m.kind == "cuda") + count_cuda_modules(m) for m in mod.imports)


def _metadata_c(metadata: dict[str, Any]) -> str:
    data = json.dumps(metadata, sort_keys=True).encode() + b"\0"
    body = ",".join(str(b) for b in data)
    decl = f"const unsigned char {METADATA_SYMBOL}[{len(data)}]"
    # extern: a C++ compiler would otherwise give a const array internal linkage. The visibility
    # attribute goes on the first declaration (gcc ignores it on a later definition, with a warning).
    return (
        '#ifdef __cplusplus\nextern "C" {\n#endif\n'
        f'extern __attribute__((visibility("default"))) {decl};\n{decl} = {{{body}}};\n'
        "#ifdef __cplusplus\n}\n#endif\n"
    )


def _reserve_temp(path: Path) -> Path:
    """An empty temporary file beside ``path`` (same file system, so ``os.replace`` is atomic);
    a directory that cannot be written fails here, before anything is built."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise CompileError(f"cannot write {path}: {err.strerror} ({err.filename})") from err
    os.close(fd)
    return Path(tmp)


def export_library(executable, path: str | os.PathLike, spec: TargetSpec,
                   metadata: dict[str, Any], workdir: str | None = None,
                   weights: Weights | None = None, shards: list[Weights] | None = None) -> Path:
    """Write ``executable`` (a ``relax.VMExecutable``) to ``path`` as one self-contained ``.so``,
    and ``weights`` (``[(name, tensor)]``, the parameters ``main`` takes after its inputs) to
    ``<name>.safetensors`` beside it when given; ``shards``: a tensor-parallel library's weights
    per rank, to ``<name>.rank<i>.safetensors`` (metadata ``weight_shards``).

    Each file is written to a temporary file in ``path``'s directory and renamed into place,
    so a failed export (nvcc, a full disk, a read-only directory) never clobbers an existing
    library. ``workdir`` (default: a temporary directory, removed afterwards) holds the objects.
    """
    path = Path(path)
    tmp = _reserve_temp(path)
    files = [(weights_path(path), weights)] if weights else []
    files += [(weights_path(path, rank), shard) for rank, shard in enumerate(shards or [])]
    temps = [_reserve_temp(wpath) for wpath, _ in files]
    try:
        entries = [write_weights(w, wtmp, wpath.name) for (wpath, w), wtmp in zip(files, temps)]
        if weights:
            metadata = metadata | {"weights": entries[0]}
        elif shards:
            metadata = metadata | {"weight_shards": entries}
        if workdir is not None:
            _export(executable, tmp, path, spec, metadata, workdir)
        else:
            wdir = tempfile.mkdtemp(prefix="tvmfuse-export-")
            _export(executable, tmp, path, spec, metadata, wdir)
            shutil.rmtree(wdir, ignore_errors=True)  # kept on failure: nvcc's error names its source
        os.chmod(tmp, 0o755)  # mkstemp made it 0600; a library is read by whoever loads it
        for (wpath, _), wtmp in zip(files, temps):
            os.chmod(wtmp, 0o644)
            os.replace(wtmp, wpath)
        os.replace(tmp, path)
    except CompileError:
        raise
    except OSError as err:  # a full disk, a file system gone read-only
        raise CompileError(f"exporting {path} failed: {err.strerror or err} "
                           f"({err.filename or tmp})") from err
    except Exception as err:  # TVM raises RuntimeError, ValueError, TVMError subclasses
        raise CompileError(f"exporting {path} failed: {err}") from err
    finally:
        tmp.unlink(missing_ok=True)
        for wtmp in temps:
            wtmp.unlink(missing_ok=True)
    return path


def _export(executable, tmp: Path, path: Path, spec: TargetSpec, metadata: dict[str, Any],
            workdir: str) -> None:
    """``executable.export_library`` into ``tmp`` with the fatbin rewrite and the metadata."""
    import tvm

    stats: dict[str, int] = {"cuda_modules": 0}

    def pack_imports(mod, is_system_lib: bool, prefix: str, wdir: str) -> str:
        tensor = tvm.get_global_func("runtime.ModulePackImportsToTensor")(mod)
        blob = tensor.numpy().tobytes()
        blob, stats["cuda_modules"] = rewrite_cuda_modules(
            blob, lambda src: compile_fatbin(src, spec, workdir)
        )
        target = json.dumps({"kind": "llvm"})
        obj = tvm.get_global_func("codegen.codegen_blob")(blob, is_system_lib, target, prefix)
        out = os.path.join(wdir, "devc.o")
        obj.write_to_file(out)
        return out

    meta_c = Path(workdir) / "tvmfuse_metadata.c"
    meta_c.write_text(_metadata_c(metadata))
    executable.export_library(str(tmp), fpack_imports=pack_imports, addons=[str(meta_c)],
                              workspace_dir=workdir)
    # A graph with no kernel (Identity, a constant) has no CUDA module: a valid library, its VM
    # code alone runs. Every CUDA module it has must have become a fatbin, though.
    expected = count_cuda_modules(executable.mod)
    if stats["cuda_modules"] != expected:
        raise CompileError(f"exporting {path}: {stats['cuda_modules']} of {expected} CUDA modules "
                           "compiled to a fatbin; the module format changed?")
