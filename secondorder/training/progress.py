"""Progress of :func:`fit <secondorder.training.fit>`: a tqdm bar, or a line now and then."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from .history import StepRecord

__all__ = ["Progress"]


class Progress:
    """A tqdm bar when tqdm is installed, else a plain line to stderr every two seconds.

    The optimizer's adapter writes the step's text (``TrainingStep.describe``); this
    class only decides where and how often it appears.
    """

    def __init__(self, enabled: bool, total: int | None) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.last = -math.inf
        self.total = total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def update(self, record: StepRecord, epochs: int, stats: str, validation: str = "") -> None:
        """Show the step: ``stats`` from the optimizer, ``validation`` from the last epoch."""
        if not self.enabled:
            return
        stats += validation
        if self.bar is not None:
            self.bar.set_description(f"epoch {record.epoch}/{epochs}", refresh=False)
            self.bar.set_postfix_str(stats, refresh=False)
            self.bar.update(1)
            return
        now = time.perf_counter()
        if record.step == 1 or now - self.last >= 2.0 or record.terminated:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            print(
                f"epoch {record.epoch}/{epochs} step {record.step}{of}  {stats}  "
                f"{record.time:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    def message(self, text: str) -> None:
        """Print a line below the bar (or on stderr)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
