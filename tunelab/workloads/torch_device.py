"""Where a rank's torch workload runs: the CPU, or its own GPU (local rank modulo the visible GPUs).

Timing device work needs a wait: CUDA kernels run asynchronously, so a step's wall time is only its
time once the device has finished it (:func:`finish`).
"""

from __future__ import annotations

from typing import Any

from ..errors import TunelabError

DEVICES = ("cpu", "cuda")


def torch_device(name: str, local_rank: int) -> Any:
    """The ``torch.device`` for ``name`` on this rank; TunelabError with the reason when CUDA is missing."""
    import torch

    if name not in DEVICES:
        raise TunelabError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible CUDA device"
        raise TunelabError(f"--device cuda needs a GPU and a CUDA build of torch; this rank has {build}")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def finish(device: Any) -> None:
    """Wait until ``device`` has done everything queued on it (no-op on the CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def ranks_share_a_gpu(comm: Any) -> bool:
    """Whether some GPU serves more than one rank of this host (then NCCL refuses the ranks, and
    the framework baseline runs over gloo)."""
    import torch
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return host.size > torch.cuda.device_count()
    finally:
        host.Free()
