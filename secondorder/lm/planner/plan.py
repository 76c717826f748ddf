"""What one LM step will allocate, stage by stage (:class:`MemoryPlan`), and its refusal."""

from __future__ import annotations

from dataclasses import dataclass

from ..stages import Stage

__all__ = ["MemoryPlan", "PlanError", "size_text"]


class PlanError(MemoryError):
    """A step that cannot fit the memory available, raised before anything is allocated.

    Attributes:
        plan: the :class:`MemoryPlan` that did not fit; ``plan.advice`` lists the
            options that would.
    """

    def __init__(self, plan: MemoryPlan, message: str | None = None) -> None:
        super().__init__(message or plan.explain())
        self.plan = plan


@dataclass(frozen=True)
class MemoryPlan:
    """What one LM step will allocate, stage by stage, and whether it fits.

    Attributes:
        parameters: n, the columns of J.
        samples: samples of the batch on this process.
        rows: residual rows of the batch on this process.
        rows_total: residual rows over every process.
        jacobian: the Jacobian strategy the estimate assumes.
        solver: the solver chosen (``"auto"`` resolved).
        form: ``"primal"`` or ``"dual"`` (``"auto"`` resolved).
        slice_size: samples per Jacobian slice (the batch, for whole-batch modes).
        stages: bytes of every stage.
        linearize_bytes: peak of the linearisation phase.
        solve_bytes: peak of the factorisation, solves and trial evaluations.
        peak_bytes: the larger of the two phases: the estimate of the step's peak.
        available_bytes: what the step may use (``None``: unknown, not checked).
        available_source: where ``available_bytes`` came from.
        fits: ``peak_bytes <= available_bytes`` and the slice respects the budget.
        advice: options that would fit, when this plan does not.
        pooled_rows: whether J's rows stay in a buffer reused by the next step.  The
            pool never costs a smaller slice or another solver: it is planned only
            where its buffer fits beside the chosen configuration.
    """

    parameters: int
    samples: int
    rows: int
    rows_total: int
    jacobian: str
    solver: str
    form: str
    slice_size: int
    stages: tuple[Stage, ...]
    linearize_bytes: int
    solve_bytes: int
    peak_bytes: int
    available_bytes: int | None
    available_source: str
    fits: bool
    advice: tuple[str, ...] = ()
    pooled_rows: bool = False

    def stage(self, name: str) -> int:
        """Bytes of the stage called ``name`` (0 when the step has no such stage)."""
        for s in self.stages:
            if s.name == name:
                return s.bytes
        return 0

    def explain(self) -> str:
        """A one-paragraph account of why the plan does not fit and what would."""
        biggest = sorted(self.stages, key=lambda s: -s.bytes)[:3]
        parts = ", ".join(f"{s.name} {size_text(s.bytes)}" for s in biggest if s.bytes)
        avail = (
            "an unknown amount"
            if self.available_bytes is None
            else f"{self.available_bytes:,} bytes ({size_text(self.available_bytes)})"
        )
        text = (
            f"solver={self.solver!r}, form={self.form!r}, slice_size={self.slice_size} needs "
            f"about {self.peak_bytes:,} bytes ({size_text(self.peak_bytes)}: {parts}) for n="
            f"{self.parameters:,} parameters and m={self.rows_total:,} residuals, but "
            f"{avail} are available ({self.available_source})."
        )
        if self.advice:
            text += " Options that would fit: " + "; ".join(self.advice) + "."
        else:
            text += " No option of this optimizer fits: use a smaller batch or model."
        return text

    def __str__(self) -> str:
        width = max(len(s.name) for s in self.stages)
        lines = [
            f"MemoryPlan: solver={self.solver}, form={self.form}, jacobian={self.jacobian}, "
            f"slice_size={self.slice_size}, n={self.parameters:,}, m={self.rows_total:,}",
        ]
        for s in self.stages:
            lines.append(f"  {s.name:<{width}}  {size_text(s.bytes):>10}  {s.detail}")
        lines.append(f"  {'linearize peak':<{width}}  {size_text(self.linearize_bytes):>10}")
        lines.append(f"  {'solve peak':<{width}}  {size_text(self.solve_bytes):>10}")
        lines.append(f"  {'step peak':<{width}}  {size_text(self.peak_bytes):>10}")
        avail = "unknown" if self.available_bytes is None else size_text(self.available_bytes)
        lines.append(f"  {'available':<{width}}  {avail:>10}  {self.available_source}")
        lines.append(f"  fits: {self.fits}")
        lines.extend(f"  would fit: {a}" for a in self.advice)
        return "\n".join(lines)


def size_text(nbytes: int) -> str:
    """``nbytes`` in B, KiB, MiB, GiB or TiB, for messages."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
