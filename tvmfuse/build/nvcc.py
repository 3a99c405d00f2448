"""Find nvcc and compile generated CUDA source into a fatbin of SASS only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..errors import CompileError
from ..targets import TargetSpec


def find_nvcc() -> str:
    """nvcc from ``$TVMFUSE_NVCC``, ``$CUDA_HOME``, ``PATH``, then PyPI's ``nvidia-cuda-nvcc``."""
    candidates = [os.environ.get("TVMFUSE_NVCC")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_nvcc"):
                candidates.append(os.path.join(root, sub, "bin", "nvcc"))
    except ImportError:
        pass
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise CompileError(
        "no nvcc found for AOT CUDA export: install a CUDA toolkit, "
        "`pip install 'tvmfuse[cuda]'` (nvidia-cuda-nvcc), or set TVMFUSE_NVCC"
    )


def gencode_flags(spec: TargetSpec) -> list[str]:
    """``-gencode arch=compute_XX,code=sm_YY`` per pair: SASS only, no PTX to JIT at load."""
    return [f"-gencode=arch={virt},code={real}" for virt, real in spec.gencode]


def compile_fatbin(source: str, spec: TargetSpec, workdir: str | Path, name: str = "kernels") -> bytes:
    """Compile CUDA ``source`` to a fatbin for ``spec``; the ptxas report lands in ``workdir``."""
    workdir = Path(workdir)
    src = workdir / f"{name}.cu"
    out = workdir / f"{name}.fatbin"
    src.write_text(source)
    cmd = [find_nvcc(), "--fatbin", "-O3", "-std=c++17", "-Xptxas=-v", *gencode_flags(spec),
           "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (workdir / f"{name}.ptxas.log").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise CompileError(
            f"nvcc failed for target {spec.name} (source kept at {src}):\n{' '.join(cmd)}\n{tail}"
        )
    return out.read_bytes()
