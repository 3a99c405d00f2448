"""The collectives a tensor-parallel library calls, as TVM global functions backed by torch.distributed.

A ``compile_lm(..., tensor_parallel=N)`` library is rank-agnostic: its entry points call three
packed functions (``R.call_dps_packed``, destination last) that each worker process registers once
its ``torch.distributed`` process group is up (gloo on cpu, nccl on cuda)::

    tvmfuse.tp_allreduce_sum(x, out)   out = Σ_ranks x                        (same shape)
    tvmfuse.tp_allgather(x, out)       out = concat_ranks(x) along the one axis where
                                       out.shape[a] == N · x.shape[a]
    tvmfuse.tp_rank(out)               out[:] = this process's rank           (any shape, int dtype)

The tensors reach torch zero-copy through DLPack. Needs torch only in the worker processes.
"""

from __future__ import annotations

ALLREDUCE_SUM = "tvmfuse.tp_allreduce_sum"
ALLGATHER = "tvmfuse.tp_allgather"
RANK = "tvmfuse.tp_rank"


def gather_axis(local: tuple[int, ...], full: tuple[int, ...], world: int) -> int:
    """The axis an all-gather concatenates: the one where ``full`` is ``world`` times ``local``."""
    axes = [a for a, (x, y) in enumerate(zip(local, full)) if x != y]
    if len(local) != len(full) or len(axes) != 1 or full[axes[0]] != world * local[axes[0]]:
        raise ValueError(f"all-gather of {list(local)} into {list(full)} over {world} ranks: shapes "
                         "must differ on one axis by the rank count")
    return axes[0]


def register_collectives(rank: int, world: int) -> None:
    """Register the three functions above for this process (its process group must be up)."""
    import torch
    import torch.distributed as dist
    import tvm_ffi

    def allreduce_sum(x, out) -> None:
        t = torch.from_dlpack(out)
        t.copy_(torch.from_dlpack(x))
        dist.all_reduce(t)

    def allgather(x, out) -> None:
        src, dst = torch.from_dlpack(x).contiguous(), torch.from_dlpack(out)
        axis = gather_axis(tuple(src.shape), tuple(dst.shape), world)
        parts = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(parts, src)
        dst.copy_(torch.cat(parts, dim=axis))

    def set_rank(out) -> None:
        torch.from_dlpack(out).fill_(rank)

    tvm_ffi.register_global_func(ALLREDUCE_SUM, allreduce_sum, override=True)
    tvm_ffi.register_global_func(ALLGATHER, allgather, override=True)
    tvm_ffi.register_global_func(RANK, set_rank, override=True)


__all__ = ["ALLGATHER", "ALLREDUCE_SUM", "RANK", "gather_axis", "register_collectives"]
