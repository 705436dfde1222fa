"""The run's USD ledger for paid teachers."""

from __future__ import annotations

import threading


class CostMeter:
    """USD spent by all paid teachers together, so they stop as one at the run's ceiling.

    `elsewhere_usd` is what other meters of the run (other teacher actors) spent: the ceiling
    counts it too."""

    def __init__(self, ceiling_usd: float) -> None:
        self.ceiling_usd = ceiling_usd
        self.elsewhere_usd = 0.0
        self._spent = 0.0
        self._lock = threading.Lock()

    @property
    def spent_usd(self) -> float:
        return self._spent

    def exhausted(self) -> bool:
        return self._spent + self.elsewhere_usd >= self.ceiling_usd

    def charge(self, usd: float) -> None:
        with self._lock:
            self._spent += usd

    def __repr__(self) -> str:
        return f"CostMeter(spent_usd={self._spent:.6f}, ceiling_usd={self.ceiling_usd})"
