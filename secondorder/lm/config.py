"""Typed, validated, frozen configuration of the LM optimizer.

Every field is checked when the object is built; a bad value raises at once with the
field's name, the value and what is allowed, before any model is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends import BACKEND_SOLVERS, LINALG_BACKENDS, array_module
from .damping import DAMPING_MATRICES, DAMPING_RULES
from .jacobian import JACOBIANS
from .linalg import SOLVERS

__all__ = ["FORMS", "LMConfig"]

FORMS = ("auto", "primal", "dual")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Invalid {name}={value!r}: must be a finite number > 0.")


def _nonnegative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"Invalid {name}={value!r}: must be a finite number >= 0.")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; valid choices are {choices}.")


def _open_unit(name: str, value: object, allow_none: bool = False) -> None:
    """A number strictly between 0 and 1 (or None where ``allow_none``)."""
    if value is None and allow_none:
        return
    what = "None or a number" if allow_none else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid {name}={value!r}: must be {what} in (0, 1).")
    if not 0.0 < value < 1.0:
        raise ValueError(f"Invalid {name}={value!r}: must be {what} in (0, 1).")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}={value!r}: must be an integer >= 1.")


@dataclass(frozen=True)
class LMConfig:
    """Every setting of :class:`~secondorder.lm.LevenbergMarquardt`.

    Attributes:
        lr: scales each update ``δ`` (1 is the plain LM step).
        damping: initial λ.
        damping_rule: ``"nielsen"`` (gain-ratio rule) or ``"multiplicative"``.
        damping_up, damping_down: factors of the multiplicative rule.
        damping_matrix: ``"marquardt"`` (diag JᵀJ), ``"identity"`` or ``"more"``.
        damping_min, damping_max: bounds on λ; reaching the maximum ends training.
        jacobian: ``"auto"``, ``"reverse"``, ``"forward"``, ``"batch_reverse"``,
            ``"batch_forward"`` (see :mod:`secondorder.jacobian`).
        solver: ``"auto"``, ``"cholesky"``, ``"eigh"``, ``"qr"``, ``"cg"``.
        form: ``"auto"`` (dual when residuals < parameters), ``"primal"``, ``"dual"``.
        max_attempts: attempts (λ values) per step before the step gives up.
        slice_size: samples per Jacobian slice; ``None``: the largest slice within
            ``memory_budget`` whose step fits the memory available.
        memory_budget: bytes a Jacobian slice may take when ``slice_size`` is None.
        memory_limit: bytes one step may use in all (see :mod:`secondorder.planner`);
            ``None``: 90% of the device's free memory, measured before each step.
            A step that cannot fit raises :class:`~secondorder.planner.PlanError`
            before allocating anything, and ``solver="auto"`` picks one that fits.
        geodesic: add geodesic acceleration (Transtrum & Sethna).
        geodesic_alpha: largest accepted ``2‖a‖/‖v‖``.
        min_gain_ratio: smallest gain ratio ρ of an accepted step.
        ftol, xtol, gtol: termination tolerances with scipy's meanings (0 disables).
        gram_dtype: dtype in which ``JᵀJ`` (or ``JD⁻¹Jᵀ``) is accumulated and
            factored.  ``"auto"`` (default): for float32 parameters, float32 while λ
            is large enough that the float32 rounding of the matrix cannot change the
            step by more than ``gram_auto_tol`` (relative), float64 once λ falls
            below that; float64 for every other parameter dtype (see
            :mod:`secondorder.precision`).  The float64 product costs about 2.5x
            the float32 one; a float32 matrix throughout cannot take the small-λ
            steps that need its lost digits.  ``benchmarks/precision_seeds.py``
            (sinc(10x), 2,000 points, 6 initialisations, 400 steps, one thread):
            final MSE at most 8.4e-8 (float64), 3.0e-8 (float32), 1.2e-8
            ("auto"), in 2.0-2.4 s, 1.4-1.8 s and 1.8-2.0 s; "auto" took 46-82% of
            its steps in float32.  ``torch.float32`` or ``torch.float64`` fix the
            dtype; ``None`` uses the parameters' dtype.
        gram_auto_tol: under ``gram_dtype="auto"``, the largest relative error of
            the solve that float32 may introduce, in (0, 1).  The default 0.1 plays
            the part of an inexact-Newton forcing term: a step within 10% of the
            exact damped step still reduces the model's loss by most of the exact
            step's reduction, and the gain ratio rejects any that does not.
        cg_rtol, cg_max_iter: tolerance and iteration cap of the CG solver.
        cg_forcing: ``None`` (default) solves every CG system to ``cg_rtol``.  A
            number ``η_max`` in (0, 1) makes CG an inexact-Newton solver: the
            relative tolerance of an iteration is
            ``max(cg_rtol, min(η_max, sqrt(‖Jᵀr‖ / (‖J‖_F·‖r‖))))``, loose while the
            gradient is large and tightening as it vanishes, which saves CG
            iterations far from a minimum and keeps fast local convergence near one.
        linalg_backend: where the normal equations are factored and solved:
            ``"torch"`` (default), ``"numpy"`` or ``"cupynumeric"`` (see
            :mod:`secondorder.backends`); the array modules offer the solvers
            ``"cholesky"`` and ``"eigh"``.
    """

    lr: float = 1.0
    damping: float = 1e-3
    damping_rule: str = "nielsen"
    damping_up: float = 10.0
    damping_down: float = 0.1
    damping_matrix: str = "marquardt"
    damping_min: float = 1e-12
    damping_max: float = 1e12
    jacobian: str = "auto"
    solver: str = "auto"
    form: str = "auto"
    max_attempts: int = 10
    slice_size: int | None = None
    memory_budget: int = 1 << 30
    memory_limit: int | None = None
    geodesic: bool = False
    geodesic_alpha: float = 0.75
    min_gain_ratio: float = 1e-4
    ftol: float = 1e-8
    xtol: float = 1e-8
    gtol: float = 1e-8
    gram_dtype: torch.dtype | str | None = "auto"
    gram_auto_tol: float = 0.1
    cg_rtol: float = 1e-6
    cg_max_iter: int | None = None
    cg_forcing: float | None = None
    linalg_backend: str = "torch"

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _nonnegative("damping", self.damping)
        _choice("damping_rule", self.damping_rule, DAMPING_RULES)
        if not (
            isinstance(self.damping_up, (int, float))
            and self.damping_up > 1
            and math.isfinite(self.damping_up)
        ):
            raise ValueError(
                f"Invalid damping_up={self.damping_up!r}: must be a finite number > 1."
            )
        if not (isinstance(self.damping_down, (int, float)) and 0 < self.damping_down < 1):
            raise ValueError(f"Invalid damping_down={self.damping_down!r}: must be in (0, 1).")
        _choice("damping_matrix", self.damping_matrix, DAMPING_MATRICES)
        _positive("damping_min", self.damping_min)
        _positive("damping_max", self.damping_max)
        if self.damping_min >= self.damping_max:
            raise ValueError(
                f"Invalid damping_min={self.damping_min!r} >= damping_max={self.damping_max!r}."
            )
        _choice("jacobian", self.jacobian, JACOBIANS)
        _choice("solver", self.solver, SOLVERS)
        _choice("form", self.form, FORMS)
        if self.solver == "cg" and self.form == "dual":
            raise ValueError("Invalid solver='cg' with form='dual': CG solves the primal form.")
        _positive_int("max_attempts", self.max_attempts)
        _positive_int("slice_size", self.slice_size, allow_none=True)
        _positive_int("memory_budget", self.memory_budget)
        _positive_int("memory_limit", self.memory_limit, allow_none=True)
        if not isinstance(self.geodesic, bool):
            raise TypeError(f"geodesic must be a bool, got {self.geodesic!r}")
        _positive("geodesic_alpha", self.geodesic_alpha)
        if isinstance(self.min_gain_ratio, bool) or not isinstance(
            self.min_gain_ratio, (int, float)
        ):
            raise TypeError(
                f"Invalid min_gain_ratio={self.min_gain_ratio!r}: must be a number in [0, 1)."
            )
        if not (0.0 <= self.min_gain_ratio < 1.0):
            raise ValueError(f"Invalid min_gain_ratio={self.min_gain_ratio!r}: must be in [0, 1).")
        for name in ("ftol", "xtol", "gtol"):
            _nonnegative(name, getattr(self, name))
        if not (
            self.gram_dtype is None
            or self.gram_dtype == "auto"
            or self.gram_dtype in (torch.float32, torch.float64)
        ):
            raise ValueError(
                f"Invalid gram_dtype={self.gram_dtype!r}: must be 'auto', None, "
                "torch.float32 or torch.float64."
            )
        _open_unit("gram_auto_tol", self.gram_auto_tol)
        _positive("cg_rtol", self.cg_rtol)
        _positive_int("cg_max_iter", self.cg_max_iter, allow_none=True)
        _open_unit("cg_forcing", self.cg_forcing, allow_none=True)
        _choice("linalg_backend", self.linalg_backend, LINALG_BACKENDS)
        if self.linalg_backend != "torch":
            if self.solver not in BACKEND_SOLVERS:
                raise ValueError(
                    f"Invalid solver={self.solver!r} with linalg_backend="
                    f"{self.linalg_backend!r}: that backend provides {BACKEND_SOLVERS}."
                )
            # Fail at construction, with install instructions, if the module is missing.
            array_module(self.linalg_backend)
