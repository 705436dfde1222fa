"""Teachers' answers on disk, so a resumed run never pays twice for a state."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshrl.teachers.base import Message

log = logging.getLogger(__name__)


def cache_key(name: str, identity: str, messages: Sequence[Mapping[str, Any]]) -> str:
    canonical = json.dumps([name, identity, messages], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class TeacherCache:
    """Teachers' actions by `cache_key`, one JSON line `{"key", "action"}` per answer.

    Each put is flushed and fsynced, so a crash loses at most the line being written; loading
    drops such a partial last line (and cuts it from the file, so the next append starts on a
    line of its own). A corrupt line elsewhere is not a crash's trace and raises. One writer
    per file (one process; its threads may share the cache).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._actions: dict[str, Message] = {}
        self._lock = threading.Lock()
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self._actions)

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            log.warning("teacher cache %s: dropping a partial last line (%d bytes)", self.path, len(data) - complete)
            with self.path.open("r+b") as f:
                f.truncate(complete)
                os.fsync(f.fileno())
        for number, line in enumerate(data[:complete].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                self._actions[record["key"]] = record["action"]
            except (ValueError, LookupError, TypeError) as error:
                raise ValueError(f"{self.path}:{number}: corrupt cache line ({error})") from error

    def get(self, key: str) -> Message | None:
        """A copy of the cached action. Needs no lock: a dict lookup is atomic and a stored
        action is never changed (`put` stores a fresh copy)."""
        action = self._actions.get(key)
        return copy.deepcopy(action) if action is not None else None

    def put(self, key: str, action: Message) -> None:
        """Append and fsync, under the lock so concurrent puts never interleave lines."""
        line = json.dumps({"key": key, "action": action}, ensure_ascii=False) + "\n"
        with self._lock:
            with self.path.open("ab") as f:
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())
            self._actions[key] = copy.deepcopy(action)
