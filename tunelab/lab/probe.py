"""What a lab link sustains: one TCP stream from host 0 to host 1 for a fraction of a second.

The shaped rate is a ceiling; on a small machine the host's cores may not drive a fast link that
fast, and every figure measured in the lab should be read against what the link really carried.
``python -m tunelab.lab.probe serve|send ADDR PORT SECONDS`` is run inside the hosts' namespaces.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from .spec import LabState

_PORT = 45127
_CHUNK = 1 << 20


def _serve(addr: str, port: int, seconds: float) -> None:
    with socket.create_server((addr, port)) as server:
        server.settimeout(seconds + 20)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(_CHUNK)
            got, start = 0, None
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                if start is None:
                    start = time.perf_counter()
                got += n
            elapsed = time.perf_counter() - (start or time.perf_counter())
    print(f"{got * 8 / max(elapsed, 1e-9) / 1e9:.4f}", flush=True)


def _send(addr: str, port: int, seconds: float) -> None:
    data = bytes(_CHUNK)
    with socket.create_connection((addr, port), timeout=seconds + 20) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(data)


def measure_link(state: LabState, seconds: float = 0.6) -> float | None:
    """Gb/s one TCP stream sustained from the lab's first host to its second (None if it failed)."""
    src, dst = state.hosts[0], state.hosts[1]
    py = [sys.executable, "-m", "tunelab.lab.probe"]
    args = [dst.address, str(_PORT), str(seconds)]
    server = subprocess.Popen(["ip", "netns", "exec", dst.name, *py, "serve", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            return None
        subprocess.run(["ip", "netns", "exec", src.name, *py, "send", *args], timeout=seconds + 30,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        out, _ = server.communicate(timeout=30)
        return float(out.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main(argv: list[str]) -> int:
    mode, addr, port, seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
    (_serve if mode == "serve" else _send)(addr, port, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
