"""What this host is: CPU, memory, MPI library and software versions (for benchmark records)."""

from __future__ import annotations

import os
import platform
import socket


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def host_info() -> dict[str, object]:
    """Facts about this host and the software stack that shape communication speed."""
    import numpy

    info: dict[str, object] = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count() or 0,
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    except ImportError:
        pass
    return info
