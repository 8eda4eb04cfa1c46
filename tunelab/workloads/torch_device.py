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


def gpu_slot(world_rank: int, host_rank: int) -> int:
    """Which of the machine's GPUs a rank takes (modulo their count): its place among the ranks of its
    machine.  That is ``host_rank`` (emulated nodes share their host's GPUs), but in the lab, whose
    hosts are network namespaces of this one machine (each with its own local ranks), every rank of the
    job is on this machine: its world rank, or every lab host's first rank would take GPU 0."""
    from ..lab.launch import current_lab

    return world_rank if current_lab() is not None else host_rank


def ranks_share_a_gpu(comm: Any, device: Any) -> bool:
    """Whether some GPU serves more than one rank of a host (then NCCL refuses the ranks, and the
    framework baseline runs over gloo), the same answer on every rank.  Ranks compare their GPUs'
    UUIDs: counting the GPUs a rank sees would call ranks that each see one GPU of their own
    (``CUDA_VISIBLE_DEVICES`` per rank) ranks sharing one."""
    from mpi4py import MPI

    from ..lab.launch import current_lab

    if current_lab() is not None:  # the lab's hosts are one machine: its GPUs are shared by all of them
        ids = comm.allgather(gpu_id(device))
        return len(set(ids)) < len(ids)
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ids = host.allgather(gpu_id(device))
    finally:
        host.Free()
    return bool(comm.allreduce(len(set(ids)) < len(ids), op=MPI.LOR))


def gpu_id(device: Any) -> str:
    """The physical GPU behind ``device`` (its UUID; the PCI address where torch does not give one)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:" + ":".join(str(getattr(props, f, "?")) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
