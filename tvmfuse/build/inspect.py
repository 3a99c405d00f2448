"""Read back what an exported library embeds: the serialised modules and the fatbin's SASS."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from ..errors import LibraryError
from .export import BlobReader, parse_cuda_payload

BLOB_SYMBOL = "__tvm_ffi__library_bin"


def module_blob(path: str | os.PathLike) -> bytes:
    """The library's import blob, ``<u64 nbytes>`` header included (what export rewrote)."""
    import tvm  # noqa: F401  (loads the FFI symbols the library refers to)

    try:
        lib = ctypes.CDLL(os.fspath(path))
        base = ctypes.addressof(ctypes.c_char.in_dll(lib, BLOB_SYMBOL))
    except (OSError, ValueError) as err:
        raise LibraryError(f"{path}: no TVM module blob ({err})") from err
    (nbytes,) = struct.unpack("<Q", ctypes.string_at(base, 8))
    return ctypes.string_at(base, nbytes + 8)


def embedded_modules(path: str | os.PathLike) -> list[tuple[str, bytes]]:
    """``[(kind, payload)]`` of every serialised module in the library's import blob."""
    r = BlobReader(module_blob(path), 8)
    indptr = r.u64_vec()
    r.u64_vec()
    mods = []
    for _ in range(len(indptr) - 1):
        kind = r.raw().decode()
        mods.append((kind, b"" if kind == "_lib" else r.raw()))
    return mods


def cuda_images(path: str | os.PathLike) -> list[tuple[str, bytes]]:
    """``[(fmt, code)]`` of the CUDA modules: fmt is "fatbin" for tvmfuse exports."""
    images = []
    for kind, payload in embedded_modules(path):
        if kind == "cuda":
            fmt, _, code = parse_cuda_payload(payload)
            images.append((fmt, code))
    return images


def launch_tags(path: str | os.PathLike) -> dict[str, list[str]]:
    """``{kernel: launch parameter tags}`` of every CUDA kernel the library embeds (the function
    map TVM's runtime launches by: thread axes, dynamic shared memory, launch flags)."""
    tags: dict[str, list[str]] = {}
    for kind, payload in embedded_modules(path):
        if kind != "cuda":
            continue
        _, fmap, _ = parse_cuda_payload(payload)
        r = BlobReader(fmap)
        for _ in range(r.u64()):
            r.raw()  # key
            name = r.raw().decode()
            r.skip(4 * r.u64())  # arg_types
            tags[name] = [r.raw().decode() for _ in range(r.u64())]
            r.skip(4 * r.u64())  # arg_extra_tags
    return tags


def cuda_source(module) -> str | None:
    """CUDA source of the first ``cuda`` module in ``module`` (a runtime module, or an executable
    with ``.mod``) and its imports; None when there is none (e.g. built for ``llvm`` only)."""
    mods = [getattr(module, "mod", module)]
    while mods:
        mod = mods.pop()
        if mod.kind == "cuda":
            return mod.inspect_source()
        mods += list(mod.imports)
    return None


def pipelined_loop(source: str) -> str | None:
    """Body of the first top-level ``for`` of TVM's generated CUDA that issues cp.async: the
    pipelined K loop of an sm80 GEMM (brace matching); None when there is none."""
    for start in (m.start() for m in re.finditer(r"\n  for \(", source)):
        depth, i = 0, source.index("{", start)
        for j in range(i, len(source)):
            depth += {"{": 1, "}": -1}.get(source[j], 0)
            if depth == 0:
                break
        if "cp_async" in source[i:j]:
            return source[i:j]
    return None


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, $CUDA_HOME or PyPI's ``nvidia-cuda-cuobjdump``."""
    cands = [shutil.which("cuobjdump")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    try:
        import nvidia

        cands += [os.path.join(p, "cu13", "bin", "cuobjdump") for p in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in cands if c and os.path.isfile(c)), None)


def fatbin_sass(fatbin: bytes) -> dict[str, str]:
    """``{sm_XX: SASS text}`` for every ELF in a fatbin (needs cuobjdump)."""
    tool = find_cuobjdump()
    if tool is None:
        raise LibraryError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.fatbin"
        f.write_bytes(fatbin)
        listing = subprocess.run([tool, "--list-elf", str(f)], capture_output=True, text=True)
        if listing.returncode != 0:
            raise LibraryError(f"cuobjdump cannot read the fatbin: {listing.stderr.strip()}")
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")  # nvdisasm beside it
        result = {}
        for arch in sorted(set(re.findall(r"\.(sm_\d+a?)\.cubin", listing.stdout))):
            sass = subprocess.run([tool, "-sass", "-arch", arch, str(f)],
                                  capture_output=True, text=True, env=env)
            if sass.returncode != 0:
                raise LibraryError(f"cuobjdump -sass failed: {sass.stderr.strip()}")
            result[arch] = sass.stdout
        ptx = subprocess.run([tool, "--list-ptx", str(f)], capture_output=True, text=True)
        if ptx.stdout.strip():
            result["ptx"] = ptx.stdout
        return result
