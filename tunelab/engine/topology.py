"""Who is where: world, node-local and cross-node communicators.

A *node* is a set of ranks that share memory.  Real nodes come from
``MPI.COMM_TYPE_SHARED``; ``ranks_per_node=K`` splits each real node further into
emulated nodes of K ranks (which still share memory), so several "nodes" can be
tested on one host.  Traffic between emulated nodes goes through MPI, as it
would between hosts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import TopologyError

if TYPE_CHECKING:
    from mpi4py import MPI


@dataclass
class Topology:
    world: MPI.Comm      # private duplicate of the user's communicator
    local: MPI.Comm      # ranks of this (possibly emulated) node, sharing memory
    cross: MPI.Comm      # one rank per node: those with this rank's local rank
    host_size: int         # ranks on this real host (they share its cores)
    node_sizes: tuple[int, ...]
    node_of: tuple[int, ...] = ()  # node index of every world rank
    host_of: tuple[int, ...] = ()  # real host of every world rank (its lowest world rank)
    host_cores: int | None = None  # cores this host's ranks may run on together (the union of their CPU
                                   # affinities; None where the platform does not say)

    def emulated_boundary(self, a: int, b: int) -> bool:
        """Whether world ranks ``a`` and ``b`` are on different emulated nodes of one real host."""
        return self.node_of[a] != self.node_of[b] and self.host_of[a] == self.host_of[b]

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.local.rank

    @property
    def host_rank(self) -> int:
        """This rank's index among the ranks of its real host (``local_rank`` counts within an emulated
        node): what picks a rank's GPU, since emulated nodes share the host's GPUs."""
        if not self.host_of:
            return self.local_rank
        me = self.host_of[self.rank]
        return sum(1 for r in range(self.rank) if self.host_of[r] == me)

    @property
    def local_size(self) -> int:
        return self.local.size

    @property
    def cross_rank(self) -> int:
        return self.cross.rank

    @property
    def cross_size(self) -> int:
        return self.cross.size

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def homogeneous(self) -> bool:
        return len(set(self.node_sizes)) == 1

    def free(self) -> None:
        for comm in (self.cross, self.local, self.world):
            comm.Free()


def private_copy(comm: MPI.Comm, timeout_s: float, what: str) -> MPI.Comm:
    """A duplicate of ``comm``, made once every rank has come to it: CollectiveTimeoutError after
    ``timeout_s`` on the ranks that came, where one never does (a rank that died, or never calls it),
    instead of a wait for ever.  The exchanges that follow it find every rank there."""
    from .consensus import wait_or_timeout

    copy, req = comm.Idup()
    wait_or_timeout(req, timeout_s, what, comm.rank, keep=copy)
    return copy


def build_topology(comm: MPI.Comm, ranks_per_node: int | None = None, duplicate: bool = True) -> Topology:
    """Split ``comm`` into nodes; collective over ``comm``.  Raises TopologyError on every rank
    when ``ranks_per_node`` does not fit (never on some ranks only).  ``duplicate=False``: ``comm`` is
    already a private copy (:func:`private_copy`), and the topology takes it over (freed with it, or
    here on an error)."""
    from mpi4py import MPI

    world = comm.Dup() if duplicate else comm
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    problem = ""
    if ranks_per_node is not None and ranks_per_node < 1:
        problem = f"ranks_per_node must be >= 1, got {ranks_per_node}"
    elif ranks_per_node is not None and ranks_per_node > host.size:
        problem = (f"ranks_per_node={ranks_per_node} but only {host.size} ranks share host "
                   f"{MPI.Get_processor_name()}")
    problems = [p for p in world.allgather(problem) if p]
    if problems:
        host.Free()
        world.Free()
        raise TopologyError(problems[0])
    if ranks_per_node is None:
        local = host.Dup()
    else:
        local = host.Split(color=host.rank // ranks_per_node, key=host.rank)
    host_size = host.size
    host_cores = _host_cores(host)
    host_leaders = world.allgather(host.allreduce(world.rank, op=MPI.MIN))
    host.Free()
    # Number nodes by their lowest world rank so every rank sees the same order.
    leaders = world.allgather(local.allreduce(world.rank, op=MPI.MIN))
    order = sorted(set(leaders))
    node_index = order.index(leaders[world.rank])
    cross = world.Split(color=local.rank, key=node_index)
    sizes = [0] * len(order)
    for leader in leaders:
        sizes[order.index(leader)] += 1
    return Topology(world=world, local=local, cross=cross, host_size=host_size,
                    node_sizes=tuple(sizes), node_of=tuple(order.index(x) for x in leaders),
                    host_of=tuple(host_leaders), host_cores=host_cores)


def _host_cores(host: MPI.Comm) -> int | None:
    """How many cores the ranks of ``host`` (one real host) may run on together: the union of their
    CPU affinities (collective over ``host``).  ``taskset`` or a cgroup's cpuset narrows it; so does a
    launcher that binds each rank to a core of its own (``-bind-to core``, Slurm, Open MPI's default for
    few ranks) where the host has more cores than ranks: such a job does run on fewer cores (its kernels
    get one a rank) and is other hardware to the fingerprint.  Bound ranks that hold every core between
    them count them all, as an unbound job does.  None where the platform has no affinity."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = None
    everyone = host.allgather(mine)
    if any(cores is None for cores in everyone):
        return None
    return len(set().union(*everyone))
