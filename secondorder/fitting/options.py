"""Checking a :func:`~secondorder.fitting.least_squares` call: its options, start and scale.

Each check raises with scipy's message shape before anything is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._validation import check_choice, check_integer, check_number
from ..lm.damping import (
    DAMPING_MATRICES,
    FITTING_DAMPING_RULES,
)
from .bounds import BoxTransform
from .losses import LOSSES

JACS = ("auto", "fwd", "rev", "2-point", "3-point", "cs")
SOLVERS = ("cholesky", "eigh", "qr", "cg")
METHODS = ("trf", "dogbox", "lm")
TR_SOLVERS = (None, "exact", "lsmr")
#: ``tr_options`` for ``tr_solver="lsmr"`` and what they become for the CG solver.
LSMR_OPTIONS = ("atol", "btol", "maxiter", "regularize")
EPS = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class Options:
    """The solver's options, checked on construction with the messages users see."""

    jac: str | Callable[..., Any]
    method: str
    loss: str | Callable[..., Any]
    f_scale: float
    ftol: float | None
    xtol: float | None
    gtol: float | None
    max_nfev: int | None
    damping: float
    damping_rule: str
    damping_matrix: str | None
    solver: str | None
    geodesic: bool
    tr_solver: str | None
    tr_options: dict[str, Any] | None
    verbose: int
    jac_sparsity: Any

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if not callable(self.jac):
            check_choice("jac", self.jac, JACS, extra=" or a callable")
        if not callable(self.loss):
            check_choice("loss", self.loss, LOSSES, extra=" or a callable rho(z) -> (3, m)")
        if self.method == "lm" and self.loss != "linear":
            raise ValueError(
                f"method='lm' supports only the 'linear' loss (as in scipy), got "
                f"loss={self.loss!r}: pass method='trf' for a robust loss"
            )
        check_number("f_scale", self.f_scale, above=0, type_error=False)
        for name, tol in (("ftol", self.ftol), ("xtol", self.xtol), ("gtol", self.gtol)):
            if tol is not None:
                check_number(name, tol, at_least=0, type_error=False)
        self._check_tolerances()
        check_integer("max_nfev", self.max_nfev, allow_none=True)
        check_choice("damping_rule", self.damping_rule, FITTING_DAMPING_RULES)
        if self.damping_matrix is not None:
            check_choice("damping_matrix", self.damping_matrix, DAMPING_MATRICES)
        if self.solver is not None:
            check_choice("solver", self.solver, SOLVERS)
        check_number("damping", self.damping, at_least=0, type_error=False)
        if self.verbose not in (0, 1, 2) or isinstance(self.verbose, bool):
            raise ValueError(f"Invalid verbose={self.verbose!r}: must be 0, 1 or 2 (as in scipy).")
        self._check_trust_region_solver()
        if self.jac_sparsity is not None and self.method == "lm":
            raise ValueError(
                "method='lm' does not support jac_sparsity (as in scipy): pass method='trf', "
                "or drop jac_sparsity"
            )
        if self.jac_sparsity is not None and self.jac in ("fwd", "rev"):
            raise ValueError(
                f"jac_sparsity groups finite-difference columns, but jac={self.jac!r} is "
                "automatic differentiation (exact, with no columns to group): drop "
                "jac_sparsity, or pass jac='2-point'"
            )

    def _check_tolerances(self) -> None:
        tols = {
            k: v or 0.0 for k, v in (("ftol", self.ftol), ("xtol", self.xtol), ("gtol", self.gtol))
        }
        if self.method == "lm" and any(v < EPS for v in tols.values()):
            low = [f"{k}={v!r}" for k, v in tols.items() if v < EPS]
            raise ValueError(
                f"All tolerances must be higher than machine epsilon ({EPS:.2e}) for method "
                f"'lm' (as in scipy), got {', '.join(low)}: raise them or pass method='trf'"
            )
        if all(v < EPS for v in tols.values()):
            raise ValueError(
                f"At least one of the tolerances must be higher than machine epsilon "
                f"({EPS:.2e}), got ftol={self.ftol!r}, xtol={self.xtol!r}, gtol={self.gtol!r}: "
                "without one the iteration would stop only on max_nfev"
            )

    def _check_trust_region_solver(self) -> None:
        check_choice("tr_solver", self.tr_solver, TR_SOLVERS)
        if self.tr_options is not None and not isinstance(self.tr_options, dict):
            raise TypeError(f"tr_options must be a dict, got {self.tr_options!r}")
        if self.solver is not None and self.tr_solver is not None:
            iterative = self.solver == "cg"
            if iterative != (self.tr_solver == "lsmr"):
                raise ValueError(
                    f"tr_solver={self.tr_solver!r} and solver={self.solver!r} disagree: "
                    "'lsmr' is the iterative solver='cg', 'exact' a factorisation ('qr', "
                    "'cholesky', 'eigh'); pass one of them"
                )
        options = self.tr_options or {}
        if options and self.linear_solver != "cg":
            raise ValueError(
                f"tr_options={options!r} apply to tr_solver='lsmr' (the iterative solver); "
                f"the solver here is {self.linear_solver!r}: pass tr_solver='lsmr' or drop them"
            )
        unknown = sorted(set(options) - set(LSMR_OPTIONS))
        if unknown:
            raise TypeError(
                f"tr_options has unsupported keys {unknown}; valid keys are {LSMR_OPTIONS} "
                "(LSMR's atol/btol/maxiter become the CG solver's tolerance and iteration "
                "limit)"
            )
        for key in ("atol", "btol"):
            if key in options:
                check_number(f"tr_options['{key}']", options[key], above=0, type_error=False)
        if "maxiter" in options:
            check_integer("tr_options['maxiter']", options["maxiter"], allow_none=True)

    @property
    def linear_solver(self) -> str:
        """The solver that runs: ``solver``, else ``"cg"`` for "lsmr", else ``"qr"``."""
        if self.solver is not None:
            return self.solver
        lsmr = self.tr_solver == "lsmr" or (self.tr_solver is None and bool(self.tr_options))
        return "cg" if lsmr else "qr"


def check_call(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    geodesic: bool,
    callback: Callable[..., Any] | None,
    workers: Any,
) -> dict[str, Any]:
    """Check ``args``, ``kwargs``, ``geodesic``, ``callback``, ``workers`` and ``fun``."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments of fun, got {args!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"kwargs must be a dict of extra keyword arguments of fun, got "
            f"{type(kwargs).__name__} {kwargs!r}: pass kwargs={{'name': value}}"
        )
    if not isinstance(geodesic, bool):
        raise TypeError(f"Invalid geodesic={geodesic!r}: must be True or False.")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {callback!r}")
    if workers not in (None, 1):
        raise ValueError(
            f"workers={workers!r} is not supported: secondorder calls fun serially; "
            "pass workers=None (or vectorise fun)"
        )
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}")
    return dict(kwargs or {})


def start_point(x0: Any) -> tuple[Tensor, bool]:
    """``x0`` as a fresh 1-D finite float64 tensor, and whether it came as NumPy/sequence.

    A scalar is a one-parameter problem (scipy's ``atleast_1d``).
    """
    if (isinstance(x0, Tensor) and x0.is_complex()) or (
        not isinstance(x0, Tensor) and np.iscomplexobj(x0)
    ):
        raise ValueError(f"x0 must be real, got a complex array {x0!r}")
    if isinstance(x0, Tensor) and x0.device.type != "cpu":
        raise ValueError(
            f"x0 is on device {x0.device}; least_squares runs on the CPU: pass x0.cpu()"
        )
    numpy_in = not isinstance(x0, Tensor)
    try:
        x_start = torch.as_tensor(np.asarray(x0, dtype=np.float64)) if numpy_in else x0
    except (TypeError, ValueError) as exc:
        raise TypeError(f"x0 must be a 1-D array of numbers, got {x0!r}") from exc
    if not x_start.is_floating_point():
        x_start = x_start.to(torch.float64)
    x_start = x_start.detach().to(torch.float64).clone()
    if x_start.ndim == 0:
        x_start = x_start.reshape(1)
    if x_start.ndim != 1 or x_start.numel() == 0:
        raise ValueError(f"x0 must be a non-empty 1-D array, got shape {tuple(x_start.shape)}")
    if not bool(torch.isfinite(x_start).all()):
        raise ValueError(f"x0 must be finite, got {x_start.tolist()}")
    return x_start, numpy_in


def positive_vector(name: str, value: Any, n: int) -> Tensor:
    """A positive finite scalar or length-``n`` array, as an ``(n,)`` float64 tensor."""
    try:
        t = torch.as_tensor(np.asarray(value, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} must be a positive number or an array of {n} positive numbers, got {value!r}"
        ) from exc
    if t.ndim == 0:
        t = t.expand(n).clone()
    if t.shape != (n,):
        raise ValueError(
            f"{name} must be a scalar or have x0's shape ({n},), got shape {tuple(t.shape)}"
        )
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0 everywhere, got {t.tolist()}")
    return t


def scale_vector(x_scale: Any, n: int, opts: Options) -> Tensor | None:
    """The fixed scaling vector for an array ``x_scale``; ``None`` for ``"jac"``/default."""
    if x_scale is None or (isinstance(x_scale, str) and x_scale == "jac"):
        if isinstance(x_scale, str) and opts.damping_matrix not in (None, "more"):
            raise ValueError(
                f"x_scale='jac' is Moré's scaling, damping_matrix='more', but "
                f"damping_matrix={opts.damping_matrix!r} was passed: pass one of them"
            )
        return None
    if isinstance(x_scale, str) or np.iscomplexobj(x_scale):
        raise ValueError(
            f"x_scale must be 'jac' or positive numbers (a scalar or one per variable), "
            f"got {x_scale!r}"
        )
    if opts.damping_matrix is not None:
        raise ValueError(
            f"x_scale={x_scale!r} sets the damping matrix to diag(1/x_scale²), but "
            f"damping_matrix={opts.damping_matrix!r} was passed too: pass one of them"
        )
    return positive_vector("x_scale", x_scale, n)


def check_feasible(x_start: Tensor, transform: BoxTransform) -> None:
    """Refuse an ``x0`` outside the bounds, as scipy does."""
    lb, ub = transform.lb, transform.ub
    if bool(((x_start < lb) | (x_start > ub)).any()):
        raise ValueError(
            f"Initial guess is outside of provided bounds: x0 is infeasible, "
            f"x0={x_start.tolist()} with lb={lb.tolist()}, ub={ub.tolist()}; pass an x0 "
            "within the bounds"
        )
