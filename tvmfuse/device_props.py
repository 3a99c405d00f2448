"""Device properties that tile and cost decisions depend on, keyed by target.

TVM's cuda Target has no field for the SM count or the bandwidth, so tvmfuse keeps a table
(:data:`DEVICES`) and a default per architecture (:data:`DEFAULT_FOR_ARCH`: ``sm_80`` → A100,
``sm_90`` / ``sm_90a`` → H200, the GPU tvmfuse is measured on). :func:`device_properties` resolves,
first match wins:

1. ``Options.device`` (:mod:`tvmfuse.options`): a name of :data:`DEVICES` or a
   :class:`DeviceProperties`;
2. ``TVMFUSE_DEVICE=NAME`` in the environment;
3. the GPU present at compile time (TVM's device API), when the target's code runs on it: its
   SM count and name over the table entry of the same part (or the target's default);
4. the target architecture's default.

Used by: ``gemm_sm80`` and ``gemm_simt_stats`` (the large tile only when its grid fills the SMs),
``gemm_sm90`` (persistent grid = SMs), ``flash_decode`` (KV splits for ~8 waves),
``gemm_sm90_stats`` (cost estimate) and ``tvmfuse report`` (roofline ceilings).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Any

from .errors import TvmfuseError
from .options import current_options
from .targets import get_target


@dataclass(frozen=True)
class DeviceProperties:
    """One GPU: SMs, shared memory (bytes; per block = the opt-in maximum), HBM bandwidth (B/s)
    and dense fp16 tensor-core FLOP/s; ``source`` says where the numbers come from."""

    name: str
    sms: int
    smem_per_block: int
    smem_per_sm: int
    bandwidth: float
    fp16_flops: float
    source: str = "table"


_KB = 1024
DEVICES: dict[str, DeviceProperties] = {
    # A100-SXM4-80GB: 164 KB shared per SM, 163 KB per block; datasheet HBM2e / fp16 dense
    "a100": DeviceProperties("A100", 108, 163 * _KB, 164 * _KB, 1.94e12, 312e12,
                             "datasheet (not measured by tvmfuse)"),
    # Hopper: 228 KB shared per SM, 227 KB per block
    "h100-sxm": DeviceProperties("H100 SXM", 132, 227 * _KB, 228 * _KB, 3.35e12, 989e12,
                                 "datasheet (not measured by tvmfuse)"),
    "h100-pcie": DeviceProperties("H100 PCIe", 114, 227 * _KB, 228 * _KB, 2.0e12, 756e12,
                                  "datasheet (not measured by tvmfuse)"),
    # measured (DESIGN.md): copy 4.21 TB/s, cuBLAS fp16 775 TFLOP/s at 4096³
    "h200": DeviceProperties("H200", 132, 227 * _KB, 228 * _KB, 4.21e12, 775e12,
                             "measured on the H200 (DESIGN.md)"),
}
DEFAULT_FOR_ARCH = {"sm_80": "a100", "sm_90": "h200", "sm_90a": "h200"}
DEFAULT_DEVICE = "h200"  # targets without a GPU (cpu) report against the GPU tvmfuse is measured on
_BY_NAME = (("A100", "a100"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"))


def lookup(name: str) -> DeviceProperties:
    """A table entry by its key (``a100``, ``h100-sxm``, ``h100-pcie``, ``h200``)."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise TvmfuseError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} "
                           "(Options.device or TVMFUSE_DEVICE)") from None


def _arch(target: Any) -> str | None:
    """``sm_80`` / ``sm_90a`` of a TVM Target, a TargetSpec or a tvmfuse target name."""
    if target is None:
        import tvm

        target = tvm.target.Target.current(allow_none=True)
        if target is None:
            return None
    if isinstance(target, str):
        target = get_target(target)
    if hasattr(target, "attrs"):  # tvm.target.Target
        if target.kind.name != "cuda":
            return None
        return str(target.attrs.get("arch", "")) or None
    return getattr(target, "arch", None)


@functools.lru_cache(maxsize=1)
def detected_gpu() -> tuple[str, str, int] | None:
    """``(name, compute capability, SMs)`` of CUDA device 0, or None without a GPU or driver."""
    import tvm

    try:
        dev = tvm.cuda(0)
        if not dev.exist:
            return None
        return str(dev.device_name), str(dev.compute_version), int(dev.multi_processor_count)
    except (RuntimeError, OSError):  # no CUDA runtime library loadable: no GPU to ask
        return None


def _from_gpu(arch: str | None) -> DeviceProperties | None:
    gpu = detected_gpu()
    if gpu is None or arch is None:
        return None
    name, capability, sms = gpu
    # sm_80 code runs on every 8.x part and (as target sm80 ships sm_90 SASS too) on 9.0
    runs = capability.startswith("8.") or capability == "9.0" if arch == "sm_80" else \
        capability == "9.0"
    if not runs:
        return None
    key = next((k for part, k in _BY_NAME if part in name), DEFAULT_FOR_ARCH.get(arch, DEFAULT_DEVICE))
    return replace(DEVICES[key], name=name, sms=sms, source=f"{DEVICES[key].source}; SMs from {name}")


def device_properties(target: Any = None) -> DeviceProperties:
    """The properties decisions for ``target`` follow (see the module docstring for the order);
    ``target``: a TVM Target, a TargetSpec, a tvmfuse target name, or None (the current Target)."""
    chosen = current_options().device or os.environ.get("TVMFUSE_DEVICE")
    if isinstance(chosen, DeviceProperties):
        return chosen
    if chosen:
        return lookup(str(chosen))
    arch = _arch(target)
    return _from_gpu(arch) or DEVICES[DEFAULT_FOR_ARCH.get(arch or "", DEFAULT_DEVICE)]
