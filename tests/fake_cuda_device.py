"""A stand-in for ``cupy.cuda.Device``: a context manager that makes a GPU current for its block, over
a shared "current GPU" that tests read (the code under test must not leave it changed)."""

from __future__ import annotations


class CurrentDevice:
    """``CurrentDevice(0)`` starts with GPU 0 current; ``.device`` is the ``cupy.cuda.Device`` stand-in."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        outer = self

        class Device:
            def __init__(self, index: int) -> None:
                self._index = index

            def __enter__(self) -> None:
                self._before, outer.index = outer.index, self._index

            def __exit__(self, *exc: object) -> None:
                outer.index = self._before

        self.device = Device
