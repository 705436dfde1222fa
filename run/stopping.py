"""Stopping a run by a signal. The first SIGINT (Ctrl-C) or SIGTERM lets the step in flight finish;
the run then checkpoints it, draws its plots, prints how to resume and exits with EXIT_INTERRUPTED.
A second signal stops at once (the newest complete checkpoint is where a resume starts).

A terminal's Ctrl-C reaches the whole foreground process group, the meshes' processes too: they are
started with SIGINT ignored (topology/placement.py), so only the controller decides how the run ends.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

EXIT_INTERRUPTED = 130  # a signal stopped the run; the message says where it resumes


class StopNow(KeyboardInterrupt):
    """A second stop signal: the run stops where it is."""


class RunInterrupted(Exception):
    """The run stopped on a signal after checkpointing the step it had in flight."""

    def __init__(self, root: Path, where: str, checkpoint: Path | None) -> None:
        self.root, self.where, self.checkpoint = root, where, checkpoint
        super().__init__(f"stopped {where}; checkpoint {checkpoint}")


def resume_hint(root: Path) -> str:
    return f"meshrl train --output-dir {root} --resume"


class StopSignals:
    """While entered, SIGINT and SIGTERM ask the run to stop (`received`); a second raises StopNow."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._before: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._before = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise StopNow(signum)
        self.received = signum
        print(f"\nmeshrl: {signal.Signals(signum).name}: stopping after the step in flight, with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)  # fmt: skip
