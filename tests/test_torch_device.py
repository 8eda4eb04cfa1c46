"""Which GPU a rank's training uses and whether ranks share one (tunelab/workloads/torch_device.py), with
stand-ins for MPI and for torch's device properties: no GPU needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from tunelab.workloads import torch_device


class FakeComm:
    """A host of ranks whose GPUs are ``ids``; this process plays one of them."""

    def __init__(self, ids: list[str]) -> None:
        self.ids, self.freed = ids, False

    def Split_type(self, kind):
        return self

    def allgather(self, mine):
        assert mine == self.ids[0]
        return list(self.ids)

    def allreduce(self, value, op=None):
        return value

    def Free(self):
        self.freed = True


@pytest.mark.parametrize(("ids", "share"), [(["GPU-a", "GPU-b", "GPU-c", "GPU-d"], False),  # one each
                                            (["GPU-a", "GPU-a"], True),                     # two on one
                                            (["GPU-a", "GPU-b", "GPU-a"], True)])
def test_ranks_share_a_gpu_when_two_see_the_same_one(monkeypatch, ids, share):
    """Four ranks that each see one GPU of their own (CUDA_VISIBLE_DEVICES per rank, so each counts one
    device) do not share: DDP runs over NCCL there, not gloo."""
    monkeypatch.setattr(torch_device, "gpu_id", lambda device: ids[0])
    comm = FakeComm(ids)
    assert torch_device.ranks_share_a_gpu(comm, "cuda:0") is share
    assert comm.freed


def test_a_gpu_is_named_by_its_uuid_else_its_pci_address(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-1234"))
    assert torch_device.gpu_id("cuda:0") == "GPU-1234"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(pci_domain_id=0, pci_bus_id=65, pci_device_id=0))
    assert torch_device.gpu_id("cuda:0") == "pci:0:65:0"
