"""Typed, validated, frozen configuration of the LM optimizer.

Every field is checked when the object is built; a bad value raises at once with the
field's name, the value and what is allowed, before any model is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._validation import (
    check_choice,
    check_integer,
    check_number,
    check_open_unit,
)
from .capturable import capture_refusal
from .classifier_defaults import residual_defaults
from .damping import (
    DAMPING_MATRICES,
    DAMPING_RULES,
    NIELSEN_SHRINK,
    check_damping_factors,
    check_damping_shrink,
)
from .jacobian import JACOBIANS
from .kfac_cg import CG_PRECONDITIONERS
from .linalg import SOLVERS
from .linalg.backends import BACKEND_SOLVERS, LINALG_BACKENDS, array_module

__all__ = ["FORMS", "LMConfig"]

FORMS = ("auto", "primal", "dual")


@dataclass(frozen=True)
class LMConfig:
    """Every setting of :class:`~secondorder.lm.LevenbergMarquardt`.

    Attributes:
        lr: scales each update ``δ`` (1 is the plain LM step).
        damping: initial λ.
        damping_rule: ``"nielsen"`` (gain-ratio rule) or ``"multiplicative"``.
            :meth:`for_residual` makes ``"multiplicative"`` the default of the
            cross-entropy adapters (see :mod:`secondorder.lm.classifier_defaults`).
        damping_up, damping_down: factors of the multiplicative rule.
        damping_shrink: the largest factor by which Nielsen's rule lowers λ after
            an accepted step, ``λ ← λ·max(1/damping_shrink, 1 - (2ρ - 1)³)``; a
            number > 1, Nielsen's 3 by default.  A larger value lets λ fall faster
            while the gain ratio stays near 1 (the end of a fit); it was not a
            robust win on the benchmarks, so it is not the default.  Only with
            ``damping_rule="nielsen"``.
        damping_matrix: ``"marquardt"`` (diag JᵀJ), ``"identity"`` or ``"more"``.
            :meth:`for_residual` makes ``"identity"`` the default of the cross-entropy
            adapters: on mini-batches Marquardt's per-batch scaling barely damps the
            weights a batch hardly touches (``classifier_defaults``).
        damping_min, damping_max: bounds on λ; reaching the maximum ends training.
        jacobian: ``"auto"``, ``"reverse"``, ``"forward"``, ``"batch_reverse"``,
            ``"batch_forward"`` (see :mod:`secondorder.lm.jacobian`).
        solver: ``"auto"``, ``"cholesky"``, ``"eigh"``, ``"qr"``, ``"cg"``.
        form: ``"auto"`` (dual when residuals < parameters), ``"primal"``, ``"dual"``.
        max_attempts: attempts (λ values) per step before the step gives up.
        slice_size: samples per Jacobian slice; ``None``: the largest slice within
            ``memory_budget`` whose step fits the memory available.
        memory_budget: bytes a Jacobian slice may take when ``slice_size`` is None.
        memory_limit: bytes one step may use in all (see :mod:`secondorder.lm.planner`);
            ``None``: 90% of the device's free memory, measured before each step.
            A step that cannot fit raises :class:`~secondorder.lm.planner.PlanError`
            before allocating anything, and ``solver="auto"`` picks one that fits.
        geodesic: add geodesic acceleration (Transtrum & Sethna).
        geodesic_alpha: largest accepted ``2‖a‖/‖v‖``.
        min_gain_ratio: smallest gain ratio ρ of an accepted step.
        ftol, xtol, gtol: termination tolerances with scipy's meanings (0 disables).
        gram_dtype: dtype in which ``JᵀJ`` (or ``JD⁻¹Jᵀ``) is accumulated and
            factored.  ``"auto"`` (default): for float32 parameters, float32 while λ
            is large enough that the float32 rounding of the matrix cannot change the
            step by more than ``gram_auto_tol`` (relative), float64 once λ falls
            below that; in the dual form float32 also below that λ when the float32
            matrix's smallest eigenvalue is certified large enough (independent
            rows, the usual mini-batch of a wide network); float64 for every other
            parameter dtype (see :mod:`secondorder.lm.precision`).  A float64
            product costs more than a float32 one; a float32 matrix throughout
            cannot take the small-λ steps that need its lost digits
            (``benchmarks/experiments/precision_seeds.py`` compares the three).
            ``torch.float32`` or ``torch.float64`` fix the dtype; ``None`` uses the
            parameters' dtype.
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
        cg_preconditioner: ``"jacobi"`` (default): ``1/(diag(JᵀJ) + λD)``.
            ``"kfac"``: each ``nn.Linear`` block of ``JᵀJ`` is approximated by its
            Kronecker factors ``G ⊗ A`` (K-FAC's Gauss-Newton approximation), which
            captures the couplings within a layer that the diagonal misses and cuts
            CG iterations on wide networks; costs one extra forward and one backward
            per residual component of a sample per step (:mod:`secondorder.lm.kfac_cg`).
            Needs ``solver="cg"`` (or ``"auto"``, when it picks CG) and per-sample
            residuals.
        linalg_backend: where the normal equations are factored and solved:
            ``"torch"`` (default), ``"numpy"`` or ``"cupynumeric"`` (see
            :mod:`secondorder.lm.linalg.backends`); the array modules offer the solvers
            ``"cholesky"`` and ``"eigh"``.
        capturable: torch.optim's name and meaning: the step is safe to capture in a
            CUDA graph.  Every decision (acceptance, λ and ν, the convergence tests)
            stays on the device and no step reads a device value on the host; on CUDA
            each batch shape's step is captured once and replayed
            (:mod:`secondorder.lm.capturable`, :mod:`secondorder.lm.graphs`).  The
            :class:`~secondorder.lm.records.StepInfo` numbers are then 0-d tensors.
            Needs the Cholesky solver and the torch backend, without geodesic steps.
        check_every: with ``capturable``, the host reads whether a step decided to
            stop (``info.terminated``) on every ``check_every``-th step only, in one
            read; 0 never reads it.  The cost: up to ``check_every - 1`` steps run
            after the one that decided to stop (ordinary steps, as when a default
            run keeps stepping after ``terminated``).
        candidates: with ``capturable``, the damping values tried in one batched
            pass per step: λ and what each rejection would raise it to.  1 (default)
            is one attempt per step; ``max_attempts`` reproduces the default step.
    """

    lr: float = 1.0
    damping: float = 1e-3
    damping_rule: str = "nielsen"
    damping_up: float = 10.0
    damping_down: float = 0.1
    damping_shrink: float = NIELSEN_SHRINK
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
    cg_preconditioner: str = "jacobi"
    linalg_backend: str = "torch"
    capturable: bool = False
    check_every: int = 10
    candidates: int = 1

    @classmethod
    def for_residual(cls, residual_fn: object, **options: Any) -> LMConfig:
        """The configuration for ``residual_fn``: its own defaults, then ``options``.

        A cross-entropy adapter gets the multiplicative damping rule unless ``options``
        names a ``damping_rule`` (:func:`~secondorder.lm.classifier_defaults.residual_defaults`);
        every other residual function gets the plain defaults, so ``for_residual(mse,
        **options) == LMConfig(**options)``.
        """
        merged: dict[str, Any] = residual_defaults(residual_fn)
        merged.update(options)
        return cls(**merged)

    def __post_init__(self) -> None:
        check_number("lr", self.lr, above=0)
        check_number("damping", self.damping, at_least=0)
        check_choice("damping_rule", self.damping_rule, DAMPING_RULES)
        check_damping_factors(self.damping_up, self.damping_down)
        check_damping_shrink(self.damping_shrink)
        if self.damping_shrink != NIELSEN_SHRINK and self.damping_rule != "nielsen":
            raise ValueError(
                f"Invalid damping_shrink={self.damping_shrink!r} with damping_rule="
                f"{self.damping_rule!r}: it sets Nielsen's rule; use damping_rule='nielsen', "
                "or damping_down for the multiplicative rule."
            )
        check_choice("damping_matrix", self.damping_matrix, DAMPING_MATRICES)
        check_number("damping_min", self.damping_min, above=0)
        check_number("damping_max", self.damping_max, above=0)
        if self.damping_min >= self.damping_max:
            raise ValueError(
                f"Invalid damping_min={self.damping_min!r} >= damping_max={self.damping_max!r}."
            )
        if self.damping > self.damping_max:
            # A λ above the maximum would end training at the first step.
            raise ValueError(
                f"Invalid damping={self.damping!r} > damping_max={self.damping_max!r}: the "
                "initial λ must be at most damping_max."
            )
        check_choice("jacobian", self.jacobian, JACOBIANS)
        check_choice("solver", self.solver, SOLVERS)
        check_choice("form", self.form, FORMS)
        if self.solver == "cg" and self.form == "dual":
            raise ValueError("Invalid solver='cg' with form='dual': CG solves the primal form.")
        check_integer("max_attempts", self.max_attempts)
        check_integer("slice_size", self.slice_size, allow_none=True)
        check_integer("memory_budget", self.memory_budget)
        check_integer("memory_limit", self.memory_limit, allow_none=True)
        if not isinstance(self.geodesic, bool):
            raise TypeError(f"Invalid geodesic={self.geodesic!r}: must be True or False.")
        check_number("geodesic_alpha", self.geodesic_alpha, above=0)
        check_number("min_gain_ratio", self.min_gain_ratio, at_least=0, below=1)
        for name in ("ftol", "xtol", "gtol"):
            check_number(name, getattr(self, name), at_least=0)
        if not (
            self.gram_dtype is None
            or self.gram_dtype == "auto"
            or self.gram_dtype in (torch.float32, torch.float64)
        ):
            raise ValueError(
                f"Invalid gram_dtype={self.gram_dtype!r}: must be 'auto', None, "
                "torch.float32 or torch.float64."
            )
        check_open_unit("gram_auto_tol", self.gram_auto_tol)
        check_number("cg_rtol", self.cg_rtol, above=0)
        check_integer("cg_max_iter", self.cg_max_iter, allow_none=True)
        check_open_unit("cg_forcing", self.cg_forcing, allow_none=True)
        check_choice("cg_preconditioner", self.cg_preconditioner, CG_PRECONDITIONERS)
        check_choice("linalg_backend", self.linalg_backend, LINALG_BACKENDS)
        if not isinstance(self.capturable, bool):
            raise TypeError(f"Invalid capturable={self.capturable!r}: must be True or False.")
        if self.capturable and self.cg_preconditioner != "jacobi":
            raise ValueError(
                f"Invalid cg_preconditioner={self.cg_preconditioner!r} with capturable=True: "
                "it preconditions the CG solver, and the capturable step factors by "
                "Cholesky; leave cg_preconditioner at 'jacobi' (its default)."
            )
        if self.cg_preconditioner != "jacobi" and self.solver not in ("cg", "auto"):
            raise ValueError(
                f"Invalid cg_preconditioner={self.cg_preconditioner!r} with solver="
                f"{self.solver!r}: it preconditions the CG solver; use solver='cg'."
            )
        check_integer("check_every", self.check_every, minimum=0)
        check_integer("candidates", self.candidates)
        if self.capturable:
            refusal = capture_refusal(
                solver=self.solver,
                linalg_backend=self.linalg_backend,
                geodesic=self.geodesic,
                damping_rule=self.damping_rule,
            )
            if refusal is not None:
                raise ValueError(refusal)
        elif self.candidates != 1:
            raise ValueError(
                f"Invalid candidates={self.candidates!r} with capturable=False: it sets the "
                "capturable step's batched attempts; use capturable=True, or max_attempts "
                "for the default step."
            )
        if self.linalg_backend != "torch":
            if self.solver not in BACKEND_SOLVERS:
                raise ValueError(
                    f"Invalid solver={self.solver!r} with linalg_backend="
                    f"{self.linalg_backend!r}: that backend provides {BACKEND_SOLVERS}."
                )
            # Fail at construction, with install instructions, if the module is missing.
            array_module(self.linalg_backend)
