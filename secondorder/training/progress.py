"""Progress of :func:`fit <secondorder.training.fit>`: a tqdm bar, or a line now and then."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from .history import EpochRecord, StepRecord

__all__ = ["Progress"]


class Progress:
    """A tqdm bar when tqdm is installed, else a plain line to stderr every two seconds.

    The optimizer's adapter writes the step's text (``TrainingStep.describe``); this
    class only decides where and how often it appears.  A validation value is shown
    beside the epoch it was measured after: once an epoch is validated, its line (the
    bar, or the plain line of its last step) shows that epoch's value; the steps of the
    next epoch show it labelled with its epoch, ``val loss 0.0123 (epoch 4)``.

    Attributes:
        LINE_INTERVAL: seconds between plain lines.
        BAR_INTERVAL: tqdm's ``mininterval``, seconds between redraws of the bar.
    """

    LINE_INTERVAL = 2.0
    BAR_INTERVAL = 0.1

    def __init__(self, enabled: bool, total: int | None, epochs: int) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.last = -math.inf
        self.total = total
        self.epochs = epochs
        self.stats = ""
        self.validation: tuple[int, str] | None = None  # (epoch, "val loss 0.0123")
        # The plain line of a step waits for the next step or for its epoch's
        # validation, so that the line of an epoch's last step shows that epoch's value.
        self.pending: tuple[StepRecord, str] | None = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(
            total=total,
            unit="step",
            dynamic_ncols=True,
            leave=True,
            mininterval=self.BAR_INTERVAL,
        )

    def _validation(self, epoch: int) -> str:
        if self.validation is None:
            return ""
        measured, text = self.validation
        return f"  {text}" if measured == epoch else f"  {text} (epoch {measured})"

    def _line(self, record: StepRecord, stats: str) -> None:
        of = f"/{self.total}" if self.total else ""
        print(
            f"epoch {record.epoch}/{self.epochs} step {record.step}{of}  "
            f"{stats}{self._validation(record.epoch)}  {record.time:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    def _flush(self) -> None:
        if self.pending is not None:
            self._line(*self.pending)
            self.pending = None

    def update(self, record: StepRecord, stats: str, validating: bool = False) -> None:
        """Show the step with ``stats``, the optimizer's text for it.

        ``validating``: an epoch's validation may follow this step; its plain line then
        waits for it (or for the next step).
        """
        if not self.enabled:
            return
        self.stats = stats
        if self.bar is not None:
            self.bar.set_description(f"epoch {record.epoch}/{self.epochs}", refresh=False)
            self.bar.set_postfix_str(stats + self._validation(record.epoch), refresh=False)
            self.bar.update(1)
            return
        self._flush()
        now = time.perf_counter()
        if record.step == 1 or now - self.last >= self.LINE_INTERVAL or record.terminated:
            self.last = now
            self.pending = (record, stats)
            if not validating:
                self._flush()

    def epoch(self, record: EpochRecord, metric: str | None) -> None:
        """Show the epoch's validation value on its line."""
        if not self.enabled or record.validation is None:
            return
        self.validation = (record.epoch, f"val {metric} {record.validation:.4g}")
        if self.bar is not None:
            self.bar.set_postfix_str(self.stats + self._validation(record.epoch), refresh=False)
            # Redraw when the epoch's last step was drawn with the previous epoch's value
            # (else the bar redraws at its own pace).
            if self.bar.last_print_n == self.bar.n:
                self.bar.refresh()
            return
        self._flush()

    def message(self, text: str) -> None:
        """Print a line below the bar (or on stderr)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            self._flush()
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the bar (or print the line that waits)."""
        if self.bar is not None:
            self.bar.close()
        else:
            self._flush()
