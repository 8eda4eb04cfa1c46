"""Launching ranks: the mpiexec beside this Python, or the user's own mpiexec/srun job.

``tunelab bench ... --np N`` starts N ranks of ``python -m tunelab.rankmain JOB``;
rank 0 writes the job's result as JSON to a file the parent reads back.  When
tunelab already runs inside an MPI job (launched by the user's mpiexec or srun),
jobs run in-process instead of launching again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import TunelabError, UsageError

if TYPE_CHECKING:
    from .lab.spec import LabState


def inside_mpi_job() -> bool:
    """True when this process was started by a launcher with more than one rank."""
    return job_size() is not None


def job_size() -> int | None:
    """The ranks of the launcher's job this process is one of, from the launcher's environment; None
    outside a job of more than one rank."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        value = os.environ.get(var, "1")
        if value not in ("", "1"):
            return int(value) if value.isdigit() else 2  # (a value no launcher writes: still a job)
    return None


def job_rank() -> int:
    """This process's rank in the launcher's job (0 outside a job), from the launcher's environment."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@lru_cache(maxsize=1)
def mpiexec_command() -> tuple[str, ...]:
    """mpiexec matching the installed libmpi (the one beside sys.executable first) and its flags."""
    beside = Path(sys.executable).parent / "mpiexec"
    exe = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not exe:
        raise TunelabError("no mpiexec found: install the MPI runtime (pip install mpich)")
    try:
        version = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        return (exe, "--oversubscribe")
    return (exe,)


def _launch_env() -> dict[str, str]:
    env = dict(os.environ)
    # Several ranks share this host's cores: OpenMP pools (torch's among them) must sleep when idle
    # instead of spin-waiting, or each rank steals the cores the others compute on.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def run_job(job: str, params: dict[str, object], np_: int, timeout_s: float | None = None,
            lab: LabState | None = None) -> dict:
    """Run ``job`` on ``np_`` ranks and return rank 0's result.  TunelabError on failure, carrying the
    first error line a rank printed.  With ``lab``, the ranks run on the lab's hosts, spread evenly."""
    if inside_mpi_job():
        if lab is not None:
            raise UsageError("--lab launches its own ranks: run it outside mpiexec/srun")
        from .rankmain import run_in_process

        return run_in_process(job, params)
    check_ranks_fit(np_)
    remove_stale_job_folders()  # what a command killed with SIGKILL left
    with tempfile.TemporaryDirectory(prefix=JOB_FOLDER_PREFIX) as tmp:
        (Path(tmp) / JOB_FOLDER_OWNER).write_text(_owner_text())
        result_path = Path(tmp) / "result.json"
        err_path = Path(tmp) / "stderr.txt"
        rank_cmd = [sys.executable, "-m", "tunelab.rankmain", job, json.dumps(params), str(result_path)]
        env = _launch_env()
        if lab is None:
            cmd = [*mpiexec_command(), "-n", str(np_), *rank_cmd]
        else:
            from .lab.launch import lab_env, mpiexec_args

            cmd, env = [*mpiexec_args(lab, np_, mpiexec_command()[0]), *rank_cmd], lab_env(env)
        remove_stale_segments()  # what a job killed with its command (SIGKILL) left
        before = mpich_segments()
        banner = _LauncherBanner()
        with open(err_path, "w") as err:
            try:
                returncode = _run_forwarding(cmd, env, err, banner, timeout_s)
            except subprocess.TimeoutExpired:
                raise TunelabError(f"{job} did not finish within {timeout_s:g} s") from None
            finally:
                remove_orphaned_segments(before)
        stderr = err_path.read_text(errors="replace")
        if returncode != 0 or not result_path.exists():
            left = _left_errors(result_path)
            message = (_first_error(left + stderr, fallback=False) or banner.describe(job)
                       or _first_error(stderr) or f"{job} failed (exit code {returncode})")
            from .rankmain import USAGE_SUFFIX

            usage = any(result_path.parent.glob(result_path.name + ".error.*" + USAGE_SUFFIX))
            raise (UsageError if usage else TunelabError)(message)  # a rank's usage error is still one
        if stderr.strip():
            sys.stderr.write(stderr)
        return json.loads(result_path.read_text())


RANK_MEMORY_MIB = 128  # what a rank holds once started (Python, numpy, Numba, MPI), measured at ~120 MiB


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available to new work (None where it gives none: not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_ranks_fit(np_: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Refuse to start more ranks on this machine than its available memory holds (each rank is a
    Python process of ``RANK_MEMORY_MIB`` or more): a typo such as ``--np 5000`` would otherwise
    start thousands of processes and leave the machine swapping or its ranks killed."""
    available = available_memory_bytes(meminfo)
    if available is None:
        return  # not Linux, or no such field: nothing to check against
    available_mib = available // (1 << 20)
    most = max(1, available_mib // RANK_MEMORY_MIB)
    if np_ > most:
        raise UsageError(f"{np_} ranks do not fit on this machine: each needs about {RANK_MEMORY_MIB} MiB and "
                         f"{available_mib} MiB are available (at most {most} ranks); use fewer, or spread "
                         "them over hosts with your own mpiexec")


SHM_DIR = Path("/dev/shm")


def mpich_segments() -> set[str]:
    """The MPICH shared-memory segments in /dev/shm now (none where there is no /dev/shm)."""
    try:
        return {p.name for p in SHM_DIR.glob("mpich_shm_*")}
    except OSError:
        return set()


def remove_orphaned_segments(before: set[str], wait_s: float = 2.0) -> None:
    """Remove the MPICH segments that appeared during a job and that no process maps any more.  MPICH
    removes its segment when a job ends normally; a job torn down by ``MPI_Abort`` or a killed rank
    leaves it behind (about 2 MiB of memory each, for good).  A segment some process still maps
    (another job's) is left alone."""
    new = mpich_segments() - before
    deadline = time.monotonic() + wait_s  # ranks of an aborted job may outlive mpiexec for a moment
    while new:
        mapped = _mapped(new)
        for name in new - mapped:
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
        new = mapped
        if not new or time.monotonic() >= deadline:
            return
        time.sleep(0.1)


JOB_FOLDER_PREFIX = "tunelab-job-"  # a launched job's folder in the temporary directory (run_job)
JOB_FOLDER_OWNER = "owner.pid"  # in it: the process of the command that made it


def _pid_namespace() -> str:
    """This process's PID namespace (containers sharing /tmp number their processes apart)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _owner_text() -> str:
    return f"{os.getpid()} {_pid_namespace()}".strip()


def remove_stale_job_folders() -> None:
    """Remove launched jobs' folders (their result, error lines and stderr) whose command no longer
    runs: a command killed with SIGKILL leaves its folder, which nothing else removes.  Only folders
    with tunelab's name and owner file, owned by this user and made in this PID namespace, are
    touched."""
    import shutil

    mine = _pid_namespace()
    for folder in Path(tempfile.gettempdir()).glob(JOB_FOLDER_PREFIX + "*"):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            pid_text, _, space = (folder / JOB_FOLDER_OWNER).read_text().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if space != mine:
            continue  # (another container's numbering: its pid says nothing here)
        if pid <= 0 or pid == os.getpid() or process_alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_segments(min_age_s: float = 300.0) -> None:
    """Remove the MPICH segments that no process maps and that are older than ``min_age_s``: a job's
    ranks map theirs from the moment it is made until the job ends, so such a segment is one a job
    torn down with its command left (a SIGKILL runs none of :func:`remove_orphaned_segments`).  The age
    keeps a job that is starting this moment, on this host, out of it."""
    now = time.time()
    old = set()
    for name in mpich_segments():
        with contextlib.suppress(OSError):
            if now - (SHM_DIR / name).stat().st_mtime >= min_age_s:
                old.add(name)
    for name in old - _mapped(old) if old else ():
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` (files in /dev/shm) some process maps."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # a process that ended meanwhile, or one we may not read
            continue
        mapped |= {name for name in names if name in text}
    return mapped


def _left_errors(result_path: Path) -> str:
    """The error lines failing ranks left beside the result (see ``rankmain.error_file``), the
    earliest first."""
    files = sorted(result_path.parent.glob(result_path.name + ".error.*"), key=lambda p: p.stat().st_mtime_ns)
    return "".join(p.read_text(errors="replace") for p in files)


def _first_error(stderr: str, fallback: bool = True) -> str:
    """The first ``tunelab: error:`` line of ``stderr``; else (``fallback``) its last non-empty line."""
    for line in stderr.splitlines():
        if line.startswith("tunelab: error: "):
            return line[len("tunelab: error: "):]
    lines = [ln for ln in stderr.splitlines() if ln.strip()] if fallback else []
    return lines[-1] if lines else ""


def _run_forwarding(cmd: list[str], env: dict[str, str], err: Any, banner: _LauncherBanner,
                    timeout_s: float | None) -> int:
    """Run the launcher; its standard output (the ranks' prints) is forwarded line by line as it comes,
    less the banner MPICH's launcher prints when a rank dies, which ``banner`` keeps instead.  When
    nobody reads our output any more (``tunelab tune | head``), the job is stopped and BrokenPipeError
    raised, as for any print of ours."""
    # Its own process group: the launcher, its proxies and the ranks can be stopped together (below).
    # Its own session also means a SIGKILL of this process reaches none of them: the launcher is told
    # to end (and end its ranks) when we die, by the kernel (Linux's parent-death signal).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
                            preexec_fn=_end_with_parent())  # noqa: PLW1509 (it takes no lock: see there)
    assert proc.stdout is not None
    reader_gone = threading.Event()

    def show(lines: list[str]) -> bool:
        try:
            for line in lines:
                sys.stdout.write(line)
            sys.stdout.flush()
            return True
        except (OSError, ValueError):
            return False

    def forward() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            lines = banner.feed(raw.decode(errors="replace"))
            if not reader_gone.is_set() and not show(lines):
                reader_gone.set()  # the main thread stops the job; the pipe is drained until it has ended
        if not reader_gone.is_set():
            show(banner.close())

    reader = threading.Thread(target=forward, name="tunelab-launcher-output", daemon=True)
    reader.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if reader_gone.is_set():
                    raise BrokenPipeError("the reader of this command's output went away") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s) from None
    except BaseException:  # the timeout, a reader gone, this process interrupted (Ctrl-C, SIGTERM)
        _stop(proc)
        raise
    finally:
        reader.join(timeout=10.0)
    if reader_gone.is_set():
        raise BrokenPipeError("the reader of this command's output went away")
    return returncode


def _end_with_parent() -> Callable[[], None] | None:
    """What the launcher's child runs before exec so that it gets SIGTERM when this process dies, even
    by SIGKILL (which runs none of our clean-up): MPICH's launcher then ends its ranks.  None where
    the kernel has no parent-death signal (not Linux).  The C function is found here, in the parent:
    the child, forked from a process with threads, should call nothing that takes a lock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # we died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop the launcher and its ranks, its whole process group: an interrupt first (MPICH's launcher
    then ends every rank and cleans up), a SIGTERM, then a kill of whatever is left.  Escalating
    matters: in one full test run the ranks did not end on the interrupt (cause not found), and a
    process started with SIGINT ignored hands that on to the launcher and the ranks."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 2.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
    with contextlib.suppress(OSError):  # ranks the launcher left behind, or the launcher itself
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class _LauncherBanner:
    """Recognises the block MPICH's launcher (hydra) prints on its standard output when a rank ends
    badly: a rule of ``=``, lines ``=   BAD TERMINATION ...``, ``=   PID 123 RUNNING AT host``,
    ``=   EXIT CODE: 9`` ..., a closing rule, and for a signal ``YOUR APPLICATION TERMINATED WITH THE
    EXIT STRING: Killed (signal 9)`` with two lines of advice.  ``feed`` returns the lines to show (the
    banner is held back); ``describe`` says in one line what it reported."""

    INTERRUPTED = ("] Sending Ctrl-C to processes as requested", "] Press Ctrl-C again to force abort")
    ADVICE = ("This typically refers to a problem with your application.",
              "Please see the FAQ page for debugging suggestions")

    def __init__(self) -> None:
        self.pid = self.host = self.exit_code = self.exit_string = ""
        self.seen = False
        self._held: list[str] = []   # lines that may open a banner: a blank line, the opening rule
        self._inside = False         # between the rules
        self._after = False          # after the closing rule: the exit string and its advice may follow

    @staticmethod
    def _rule(line: str) -> bool:
        text = line.strip()
        return len(text) >= 20 and set(text) == {"="}

    def feed(self, line: str) -> list[str]:
        text = line.rstrip("\n")
        if text.startswith("[mpiexec@") and text.endswith(self.INTERRUPTED):
            return []  # its echo of an interrupt: tunelab says "interrupted" itself
        if self._after:
            if text.startswith("YOUR APPLICATION TERMINATED WITH THE EXIT STRING:"):
                self.exit_string = text.split(":", 1)[1].strip()
                return []
            if text.strip() in self.ADVICE:
                return []
            self._after = False
        if self._inside:
            self._held.append(line)
            if self._rule(text):
                if any("BAD TERMINATION" in h for h in self._held):
                    self._parse(self._held)
                    self._held, self._inside, self._after = [], False, True
                    return []
                out, self._held, self._inside = self._held, [], False
                return out
            if not text.startswith("="):  # not the launcher's block: show it as it was
                out, self._held, self._inside = self._held, [], False
                return out
            return []
        if self._rule(text):
            self._held.append(line)
            self._inside = True
            return []
        if not text.strip():
            out, self._held = self._held, [line]  # a blank line may open the banner
            return out
        out, self._held = [*self._held, line], []
        return out

    def close(self) -> list[str]:
        out, self._held, self._inside = self._held, [], False
        return out

    def _parse(self, block: list[str]) -> None:
        self.seen = True
        for line in block:
            text = line.strip().lstrip("=").strip()
            if text.startswith("PID ") and " RUNNING AT " in text:
                pid, _, host = text[4:].partition(" RUNNING AT ")
                self.pid, self.host = pid.strip(), host.strip()
            elif text.startswith("EXIT CODE:"):
                self.exit_code = text.split(":", 1)[1].strip()

    def describe(self, job: str) -> str:
        """One line for a rank that ended badly, or "" when no banner was seen."""
        if not self.seen:
            return ""
        who = f"a rank (pid {self.pid} on {self.host})" if self.pid else "a rank"
        how = (self.exit_string.lower() if self.exit_string
               else f"exit code {self.exit_code}" if self.exit_code else "an unknown cause")
        return f"{job} failed: {who} ended with {how}; the other ranks were stopped"
