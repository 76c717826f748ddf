"""The solver, the form and the slice size of a step: one small object per decision.

A fixed option is an object with one answer.  ``"auto"`` is an object above the fixed
ones that picks among them from the step's shape, as lineax's ``AutoLinearSolver``
picks a solver from an operator's structure:

- :class:`AutoForm` takes the dual form (the m×m system ``JD⁻¹Jᵀ``) when the residuals
  are fewer than the parameters and the solver factors a matrix;
- :class:`AutoSolver` proposes Cholesky in that form while the matrix has at most
  :data:`DIRECT_SOLVE_LIMIT` rows, then Cholesky in the other form, then CG;
- :class:`AutoSlice` takes the largest slice that keeps the Jacobian slice within the
  budget and the step within the available memory.

:func:`~secondorder.lm.planner.plan_memory` prices each proposal and keeps the first
that fits, so ``"auto"`` moves away from its first answer only when memory forces it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..stages import StepShape

if TYPE_CHECKING:
    from .plan import MemoryPlan

__all__ = [
    "DIRECT_SOLVE_LIMIT",
    "FORMS",
    "SOLVERS",
    "AutoForm",
    "AutoSlice",
    "AutoSolver",
    "FixedForm",
    "FixedSlice",
    "FixedSolver",
    "FormChoice",
    "SliceChoice",
    "SolverChoice",
    "form_choice",
    "slice_choice",
    "solver_choice",
]

#: Under ``solver="auto"``, the largest normal matrix (n in the primal form, m in the
#: dual) that is factored directly; beyond it the O(size³) factorisation costs more
#: than CG's iterations, whatever the memory.
DIRECT_SOLVE_LIMIT = 8192

SOLVERS = ("auto", "cholesky", "eigh", "qr", "cg")
FORMS = ("auto", "primal", "dual")


# -- form ---------------------------------------------------------------------------------
class FormChoice(Protocol):
    """Whether a step solves the dual system for a given solver."""

    #: Whether the planner may try the other form when this one does not fit.
    may_switch: bool

    def dual(self, shape: StepShape, solver: str) -> bool:
        """Whether ``solver`` works on the m×m dual system for a step of ``shape``."""
        ...


@dataclass(frozen=True)
class FixedForm:
    """``form="primal"`` or ``form="dual"``: that form, whatever the shape."""

    is_dual: bool
    may_switch = False

    def dual(self, shape: StepShape, solver: str) -> bool:
        """The configured form."""
        return self.is_dual


@dataclass(frozen=True)
class AutoForm:
    """``form="auto"``: the dual form when residuals are fewer than parameters.

    CG works on J's rows in either case and keeps the primal form.
    """

    may_switch = True

    def dual(self, shape: StepShape, solver: str) -> bool:
        """Dual when m < n, for a solver that factors."""
        return shape.rows_total < shape.n and solver != "cg"


def form_choice(form: str) -> FormChoice:
    """The object for the configuration's ``form``."""
    if form not in FORMS:
        raise ValueError(f"Unknown form={form!r}; valid choices are {FORMS}.")
    return AutoForm() if form == "auto" else FixedForm(form == "dual")


# -- solver -------------------------------------------------------------------------------
class SolverChoice(Protocol):
    """The (solver, dual) configurations a step may use, in order of preference."""

    def candidates(self, shape: StepShape, form: FormChoice) -> list[tuple[str, bool]]:
        """Configurations to price, best first; the planner keeps the first that fits."""
        ...


@dataclass(frozen=True)
class FixedSolver:
    """A solver named by the configuration: the only candidate."""

    name: str

    def candidates(self, shape: StepShape, form: FormChoice) -> list[tuple[str, bool]]:
        """The named solver, in the form ``form`` gives it."""
        return [(self.name, form.dual(shape, self.name))]


@dataclass(frozen=True)
class AutoSolver:
    """``solver="auto"``: Cholesky while its matrix is small enough, else CG.

    Cholesky of the preferred form comes first when that form's matrix has at most
    ``limit`` rows; Cholesky of the other form next (only under ``form="auto"``);
    matrix-free CG last, which fits where nothing else does.
    """

    limit: int = DIRECT_SOLVE_LIMIT

    def candidates(self, shape: StepShape, form: FormChoice) -> list[tuple[str, bool]]:
        """Cholesky in the preferred form, Cholesky in the other, CG."""
        m_all, n = shape.rows_total, shape.n
        dual = form.dual(shape, "auto")
        out: list[tuple[str, bool]] = []
        if (m_all if dual else n) <= self.limit:
            out.append(("cholesky", dual))
        if form.may_switch and (n if dual else m_all) <= self.limit:
            out.append(("cholesky", not dual))
        out.append(("cg", False))
        return out


def solver_choice(solver: str) -> SolverChoice:
    """The object for the configuration's ``solver``."""
    if solver not in SOLVERS:
        raise ValueError(f"Unknown solver={solver!r}; valid choices are {SOLVERS}.")
    return AutoSolver() if solver == "auto" else FixedSolver(solver)


# -- slice size ---------------------------------------------------------------------------
class SliceChoice(Protocol):
    """Samples per Jacobian slice for a per-sample strategy."""

    @property
    def size(self) -> int | None:
        """The configured size (``None`` under auto).

        Whole-batch strategies use it as the chunk of cotangents they push at once.
        """
        ...

    def choose(self, samples: int, build: Callable[[int], MemoryPlan]) -> int:
        """The slice size, given ``build(s)``: the plan of slices of ``s`` samples."""
        ...

    def spread(self, size: int, samples: int, devices: int) -> int:
        """``size`` adjusted so that ``devices`` devices each get a slice."""
        ...


@dataclass(frozen=True)
class FixedSlice:
    """``slice_size=s``: ``s`` samples per slice (the batch, if smaller)."""

    size: int | None

    def choose(self, samples: int, build: Callable[[int], MemoryPlan]) -> int:
        """The configured size, at most the batch."""
        assert self.size is not None
        return min(self.size, samples)

    def spread(self, size: int, samples: int, devices: int) -> int:
        """The configured size, as given."""
        return size


@dataclass(frozen=True)
class AutoSlice:
    """``slice_size=None``: the largest slice within ``budget`` bytes that fits.

    ``budget`` bounds the Jacobian slice alone (``None``: no bound); the step's peak
    must fit the available memory.  Both grow with the slice, so the largest such
    slice is found by bisection.
    """

    budget: int | None

    @property
    def size(self) -> None:
        """No configured size."""
        return None

    def choose(self, samples: int, build: Callable[[int], MemoryPlan]) -> int:
        """The largest slice within the budget whose step fits."""

        def good(s: int) -> bool:
            plan = build(s)
            within = self.budget is None or plan.stage("jacobian slice") <= self.budget or s == 1
            return plan.fits and within

        lo, hi = 1, samples
        if good(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if good(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def spread(self, size: int, samples: int, devices: int) -> int:
        """At most ``samples / devices``, so that no device sits idle."""
        # At least one slice per device, or some devices would sit idle.
        return min(size, -(-samples // devices)) if devices > 1 else size


def slice_choice(slice_size: int | None, budget: int | None) -> SliceChoice:
    """The object for a configured ``slice_size`` (``None``: auto within ``budget``)."""
    return AutoSlice(budget) if slice_size is None else FixedSlice(slice_size)
