"""A multi-host lab on one machine.

``up`` makes H "hosts": Linux network namespaces, each with its own hostname (a UTS namespace per
launch), one veth link to a bridge, shaped with ``tc``.  MPICH's ``mpiexec`` starts ranks inside
them (``launch.py``), so ``MPI.COMM_TYPE_SHARED`` splits per host and every byte between hosts —
tunelab's rings, the coordinator, MPI_Allreduce, gloo, torch DDP, TensorFlow's workers — crosses
the shaped links over TCP.  Addresses come from a private subnet used only inside the lab.

Needs root and iproute2; ``require_privileges`` says which is missing (a usage error, exit 2).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import TunelabError, UsageError
from .spec import (
    LabHost,
    LabSpec,
    LabState,
    check_lab_dir,
    clear_lab_dir,
    lab_dir,
    lab_lock,
    load_state,
    save_state,
)

__all__ = ["LabHost", "LabSpec", "LabState", "down", "job_ranks", "load_state", "require_lab", "session",
           "status", "up"]


def up(spec: LabSpec, probe: bool = True) -> LabState:
    """Build the lab (removing whatever an earlier lab left) and return its state.  What would refuse
    the new lab is checked before the old one is taken down: a refused ``up`` leaves the lab that was
    up as it was.  One ``up`` or ``down`` at a time (``lab_lock``)."""
    from . import net

    net.require_privileges()
    with lab_lock():
        return _up_locked(spec, probe)


def _up_locked(spec: LabSpec, probe: bool, users: tuple[int, ...] = ()) -> LabState:
    """:func:`up`'s checks and build, with ``lab_lock`` held.  ``users``: the scenario run it is brought
    up for (:func:`session`); none for ``lab up``."""
    from . import net

    check_lab_dir()
    net.check_subnet_free(spec)
    netem = net.has_netem()
    if spec.link_latency_us > 0 and not netem:
        raise UsageError("this kernel has no netem qdisc, so tc cannot add link latency: leave out "
                         "--link-latency-us (the engine's emulated link, --ranks-per-node with "
                         "--link-latency-us outside the lab, still models latency)")
    return _build(spec, netem, probe, users)


def _build(spec: LabSpec, netem: bool, probe: bool, users: tuple[int, ...] = ()) -> LabState:
    from . import net
    from .launch import write_launcher
    from .probe import measure_link

    try:
        previous = load_state()
    except TunelabError:  # an unreadable state file is replaced like the rest
        previous = None
    removed = net.remove_all()
    clear_lab_dir()
    if previous is not None:
        notes = [f"replaced the lab that was up ({previous.describe()})"]
    else:
        notes = [f"removed a lab left behind: {', '.join(removed)}"] if removed else []
    if not netem:
        notes.append("no netem in this kernel: the links add no latency (bandwidth is shaped by tbf)")
    try:
        hosts = net.build(spec, netem)
        state = LabState(spec=spec, hosts=hosts, netem=netem, created=time.time(), notes=tuple(notes),
                         scenario=bool(users), users=users)
        write_launcher(lab_dir())
        save_state(state)
        if probe:
            state = dataclasses.replace(state, sustained_gbps=measure_link(state))
            save_state(state)
    except BaseException:
        net.remove_all()
        clear_lab_dir()
        raise
    return state


def down() -> list[str]:
    """Remove the lab and anything a killed run left; returns what was removed (may be empty)."""
    from . import net

    net.require_privileges()
    with lab_lock():
        removed = net.remove_all()
        clear_lab_dir()
    return removed


def status() -> tuple[LabState | None, dict[str, list[str]]]:
    """The saved lab (None if none) and the lab objects that exist now."""
    from . import net

    net.require_privileges()
    return load_state(), net.leftovers()


def require_lab(state: LabState | None = None) -> LabState:
    """The lab that is up (``state``, where the caller read it), checked against the system: UsageError
    when there is none or it is broken."""
    from . import net

    net.require_privileges()
    state = state or load_state()
    if state is None:
        raise UsageError("no lab is up: run 'tunelab lab up --hosts H --link-gbps G' first")
    missing = net.problems(state)
    if missing:
        raise UsageError(f"the lab is broken (missing {', '.join(missing)}): run 'tunelab lab up' again")
    return state


@contextmanager
def session(use_current: bool, spec: LabSpec | None = None) -> Iterator[LabState | None]:
    """The lab a command runs on: none (neither asked), the one that is up (``--lab``), or the one a
    scenario's ``[lab]`` table describes — reused when that lab is up, else brought up for the
    command.  A lab brought up for scenario runs is taken down by the last of them to end (the runs on
    it are listed in its state, under the lab's lock, so that one run's end does not pull the lab from
    under another's ranks; a run that was killed drops out of the list, and the next run to end takes
    the lab down).  A lab the user brought up (``lab up``) is left up."""
    if spec is None:
        yield require_lab() if use_current else None
        return
    import os

    from . import net

    net.require_privileges()
    me = os.getpid()
    with lab_lock():
        current = load_state()
        if current is not None:
            if (current.spec.hosts, current.spec.link_gbps) != (spec.hosts, spec.link_gbps):
                raise UsageError(f"a different lab is up ({current.describe()}) than the scenario's "
                                 f"{spec.hosts} hosts at {spec.link_gbps:g} Gb/s: run 'tunelab lab down' first")
            state = dataclasses.replace(require_lab(current), users=(*_alive(current.users), me))
            save_state(state)
        else:
            state = _up_locked(spec, probe=True, users=(me,))
    try:
        yield state
    finally:
        _leave(state, me)


def _leave(state: LabState, me: int) -> None:
    """This run is done with the lab ``state``: off its list of users, and the lab down where it was
    brought up for scenario runs and no run is left on it."""
    from . import net

    with lab_lock():
        try:
            now = load_state()
        except TunelabError:
            now = None  # (unreadable now: whoever broke it takes it down)
        if now is None or now.created != state.created:  # taken down, or replaced by another lab
            return
        users = tuple(u for u in _alive(now.users) if u != me)
        if now.scenario and not users:
            net.remove_all()
            clear_lab_dir()
        else:
            save_state(dataclasses.replace(now, users=users))


def _alive(pids: tuple[int, ...]) -> tuple[int, ...]:
    """The processes of ``pids`` that still run."""
    from ..launch import process_alive

    return tuple(pid for pid in pids if process_alive(pid))


def job_ranks(lab: LabState | None, np_: int | None, default: int = 2) -> int:
    """Ranks for a job: ``np_`` (checked to spread evenly over the lab's hosts), else the lab's hosts
    times its ranks per host, else ``default``.  Under the user's mpiexec/srun: the ranks it started
    (a ``np_`` that differs is a usage error, not a count the header would name while the job ran on
    the launcher's)."""
    from ..launch import job_size

    size = job_size()
    if size is not None:
        if np_ is not None and np_ != size:
            raise UsageError(f"--np {np_}, but the launcher started {size} ranks: leave --np out under "
                             "mpiexec/srun (its ranks are the job's)")
        return size
    if lab is None:
        return np_ or default
    from .launch import ranks_per_host

    return ranks_per_host(lab, np_) * lab.spec.hosts
