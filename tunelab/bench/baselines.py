"""Baselines measured beside tunelab in the same run: MPI_Allreduce and torch.distributed (gloo)."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

MPI_UNSUPPORTED = ("float16", "bfloat16")  # MPI has no standard reduction for these


class GlooGroup:
    """A torch.distributed process group over the same ranks (rendezvous via MPI): gloo by default,
    or ``backend="nccl"`` for GPU tensors when every rank has a GPU of its own."""

    def __init__(self, comm: MPI.Comm, backend: str = "gloo") -> None:
        import torch.distributed as dist

        self.dist = dist
        hosts = comm.allgather(socket.gethostname())
        addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        port = 0
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        # a peer that cannot reach rank 0 (or a collective that stalls) fails the run instead of hanging it
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                                world_size=comm.size, timeout=timedelta(seconds=120))

    def allreduce_(self, array: np.ndarray) -> None:
        import torch

        if array.dtype.name == "bfloat16":
            tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
        self.dist.all_reduce(tensor)

    def close(self) -> None:
        self.dist.destroy_process_group()


def torch_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()
