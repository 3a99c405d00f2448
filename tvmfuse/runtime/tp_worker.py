"""One rank of a tensor-parallel LM (:mod:`.tensor_parallel`), run as ``python -m
tvmfuse.runtime.tp_worker RANK WORLD LIBRARY DEVICE PORT TIMEOUT FD``; FD is the inherited pipe to
the parent, which sends ``(method, args, kwargs)`` and reads ``("ok", result)`` or
``("error", exception)``."""

from __future__ import annotations

import pickle
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import TvmfuseError
from . import _open
from .collectives import register_collectives
from .lm import LanguageModel
from .weights import load_weights


def _worker(rank: int, world: int, path: str, device: str, port: int, timeout: float, conn) -> None:
    """One rank: process group, collectives, the library; then answers calls until ``close``."""
    import torch.distributed as dist

    try:
        cuda = device.startswith("cuda")
        if cuda:
            import torch

            torch.cuda.set_device(int(device.split(":")[1]))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        register_collectives(rank, world)
        meta, dev, _, vm = _open(Path(path), device)
        meta = meta | {"weights": meta["weight_shards"][rank]}
        lm = LanguageModel(vm, dev, meta, Path(path), load_weights(Path(path), meta, dev, rank=rank))
        conn.send(("ok", None))
    except BaseException as err:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", _portable(err)))
        return
    try:
        while True:
            method, args, kwargs = conn.recv()
            if method == "close":
                break
            try:
                result = getattr(lm, method)(*args, **kwargs)
                conn.send(("ok", (result, lm.timings) if method == "generate" else result))
            except Exception as err:  # noqa: BLE001
                conn.send(("error", _portable(err)))
    finally:
        dist.destroy_process_group()


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles as itself (tvmfuse errors do), else a TvmfuseError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return TvmfuseError(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")


def _main(argv: list[str]) -> None:
    rank, world, path, device, port, timeout, fd = argv
    _worker(int(rank), int(world), path, device, int(port), float(timeout), Connection(int(fd)))


if __name__ == "__main__":
    _main(sys.argv[1:])

