"""Skip markers for CPU tests that need the CUDA toolchain (nvcc to build, cuobjdump to read SASS)."""

from __future__ import annotations

import re

import pytest

from tvmfuse.build.inspect import cuda_images, fatbin_sass, find_cuobjdump
from tvmfuse.build.nvcc import find_nvcc


def has_tool(find) -> bool:
    """True when ``find()`` locates the tool (it returns None or raises when it is missing)."""
    try:
        return find() is not None
    except Exception:  # noqa: BLE001 - CompileError / LibraryError: the tool is missing
        return False


needs_nvcc = pytest.mark.skipif(not (has_tool(find_nvcc) and has_tool(find_cuobjdump)),
                                reason="needs nvcc and cuobjdump")


def check_vs_float64(module, inputs, target: str, tmp_path, tol: float,
                     ref_dtype: str = "float64") -> float:
    """GPU: ``module`` through tvmfuse.compile → export → load on ``target`` against its float64
    torch run on the same inputs (``ref_dtype="float32"`` for models torch cannot run in float64);
    asserts rel err ≤ ``tol`` and returns it."""
    import torch

    import tvmfuse
    from tests.conftest import rel_err

    lib = tvmfuse.compile(module, inputs, target=target)
    run = tvmfuse.load(lib.export(tmp_path / "m.so"), device="cuda")
    out = run(*(x.cuda() for x in inputs))
    with torch.no_grad():
        dt = getattr(torch, ref_dtype)
        # .double() / .float(), not .to(dt): Module.to casts a complex buffer (a complex RoPE's
        # freqs_cis) to the real dtype too, dropping its imaginary part
        ref = getattr(module, {"float64": "double", "float32": "float"}[ref_dtype])()(
            *(x.to(dt) if x.is_floating_point() else x for x in inputs))
    err = rel_err(out, ref)
    print(f"rel_err {err:.2e}")
    assert err <= tol
    return err


def kernel_sass(path) -> dict[str, dict[str, str]]:
    """``{arch: {kernel name: its SASS}}`` of an exported library. Needs cuobjdump; its failure
    is an error (LibraryError), not a skip."""
    (fmt, code), = cuda_images(path)
    assert fmt == "fatbin", fmt
    out = {}
    for arch, text in fatbin_sass(code).items():
        if arch.startswith("sm_"):
            parts = re.split(r"\n\s*Function : (\S+)\n", text)
            out[arch] = dict(zip(parts[1::2], parts[2::2]))
    return out


def attention_sass(path) -> dict[str, str]:
    """``{arch: SASS}`` of the library's one attention kernel (asserts there is exactly one)."""
    out = {}
    for arch, kernels in kernel_sass(path).items():
        names = [n for n in kernels if "attention" in n or "flash" in n]
        assert len(names) == 1, f"{arch}: attention kernels {names} among {list(kernels)}"
        out[arch] = kernels[names[0]]
    return out


# What each attention kernel's SASS holds: (instructions it must hold, instructions it must not).
ATTENTION_SASS = {
    "wgmma": (("HGMMA.64x", "UTMALDG"), ("HMMA",)),  # flash_attention_sm90 (TMA + wgmma)
    "mma_sync": (("HMMA.16816.F32", "LDSM"), ("HGMMA",)),  # the sm80 flash kernel
    "cuda_cores": (("MUFU.EX2",), ("HMMA", "HGMMA")),  # the generic one-thread-per-row fallback
}


def assert_attention_kernel(path, kind: str) -> None:
    """The exported library's one attention kernel is the ``kind`` kernel, in every arch's SASS."""
    need, never = ATTENTION_SASS[kind]
    for arch, sass in attention_sass(path).items():
        for instr in need:
            assert instr in sass, f"{arch}: no {instr} in the attention kernel (expected {kind})"
        for instr in never:
            assert instr not in sass, f"{arch}: {instr} in the attention kernel (expected {kind})"


def kernel_bodies(source: str) -> dict[str, tuple[list[str], str]]:
    """``{name: (pointer parameters, body)}`` of every ``__global__`` kernel in CUDA source."""
    out = {}
    for m in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\) \{',
                         source):
        depth, i = 0, m.end() - 1
        for j in range(i, len(source)):
            depth += {"{": 1, "}": -1}.get(source[j], 0)
            if depth == 0:
                break
        params = re.findall(r"\*\s*__restrict__\s+(\w+)", m.group(2))
        out[m.group(1)] = (params, source[i + 1:j])
    return out
