"""The three build targets: ``cpu`` (llvm), ``sm80`` and ``sm90`` (sm_90a).

Each target knows its TVM Target, the nvcc ``-gencode`` pairs of its fatbin and which GPU compute
capabilities can run the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TvmfuseError

# The cpu target: the host's generic ISA (a library that runs on any CPU of its architecture), LLVM
# at -O2. At TVM's default -O3, fp16 kernels without F16C (every half converted by a library call)
# unroll into functions LLVM then takes minutes to compile at load, and run slower: a 64 → 96 fp16
# Linear + tanh-GELU loaded in 130 s, an fp16 elementwise chain in 14.9 s and ran 278 µs a call;
# at -O2 0.3 s and 0.1 s, 134 µs; fp32 kernels ran the same (106 µs a Linear + ReLU either way).
# (+f16c would give 10 µs, but a library that needs F16C no longer runs on any x86-64.)
CPU_TARGET = {"kind": "llvm", "opt-level": 2}


@dataclass(frozen=True)
class TargetSpec:
    """A tvmfuse target name and what it implies."""

    name: str
    arch: str | None  # "sm_80", "sm_90a", or None for the host CPU
    gencode: tuple[tuple[str, str], ...] = ()  # (virtual arch, real arch) pairs for the fatbin
    runs_on: tuple[str, ...] = ()  # compute capabilities ("8.0", "9.0") the SASS runs on

    @property
    def is_cuda(self) -> bool:
        return self.arch is not None

    def tvm_target(self):
        """The TVM Target: JSON-dict form, host llvm for CUDA."""
        import tvm

        if not self.is_cuda:
            return tvm.target.Target(CPU_TARGET)
        return tvm.target.Target({"kind": "cuda", "arch": self.arch}, host={"kind": "llvm"})

    def can_run_on(self, compute_capability: str) -> bool:
        """True when the fatbin holds SASS for this major.minor capability."""
        return compute_capability in self.runs_on or (
            # sm_80 SASS runs on every 8.x part; sm_90a only on 9.0.
            self.name == "sm80" and compute_capability.startswith("8.")
        )


TARGETS: dict[str, TargetSpec] = {
    "cpu": TargetSpec("cpu", None),
    # sm80 also carries sm_90 SASS of the same kernels so the Ampere path runs (and is measured) on Hopper.
    "sm80": TargetSpec(
        "sm80", "sm_80", (("compute_80", "sm_80"), ("compute_80", "sm_90")), ("8.0", "9.0")
    ),
    "sm90": TargetSpec("sm90", "sm_90a", (("compute_90a", "sm_90a"),), ("9.0",)),
}


def get_target(name: str) -> TargetSpec:
    """Look a target up by its tvmfuse name."""
    try:
        return TARGETS[name]
    except KeyError:
        raise TvmfuseError(
            f"unknown target {name!r}; choose one of {', '.join(TARGETS)}"
        ) from None
