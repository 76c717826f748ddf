"""The capturable LM iteration: every decision a tensor operation, no host read.

With ``capturable=True`` (torch.optim's name: the step is safe to capture in a CUDA
graph) one call of :meth:`~secondorder.lm.LevenbergMarquardt.step` linearises the
batch once and tries ``candidates`` damping values in one batched pass:
``λ₀ = λ`` and each next one what a rejection of the previous would make it.  The
gain ratio, acceptance, the convergence tests and the λ and ν updates are masks and
``torch.where`` on the solver's device, in the damping rule's tensor form
(:meth:`~secondorder.lm.damping.DampingRule.accepted`); the model's parameters are
written with the chosen point, which is the old point itself when nothing was
accepted, so a rejected step leaves them with the same values.

The first candidate accepted, in order of increasing λ, is the attempt the default
step would have accepted: with ``candidates >= max_attempts`` the two modes take the
same steps (no more than ``max_attempts`` are tried), and with fewer each call runs
the first ``candidates`` attempts of the default step and carries the raised λ to
the next call.  The reported gain ratio is the last evaluated attempt's, 0 when none
was.  One difference remains: the predicted reduction ``-2gᵀδ - ‖Jδ‖²`` is formed
without the default step's power-of-two rescaling (the same number unless ``‖Jδ‖²``
overflows the Gram's dtype, when the attempt is rejected instead).  Nielsen's
``(2ρ - 1)³`` is ``torch.pow``, libm's ``pow`` on the CPU as in the default step; a
GPU's ``pow`` may round it an ulp apart.

Only Cholesky (``torch.linalg.cholesky_ex`` and triangular solves) factors here:
``torch.linalg.eigh`` waits for the host on CUDA, CG's iteration count depends on
the data, and the array-module backends live on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed import Reducer
from .damping import DampingMatrix, DampingRule, DeviceDamping
from .iteration import EngineConfig, Problem
from .linalg import NormalEquations
from .linalg.base import _ScaledRows

__all__ = ["REPORT", "DeviceOutcome", "capture_refusal", "device_iteration"]

#: The entries of :attr:`DeviceOutcome.report`, a float64 vector, in order.
REPORT = (
    "loss",
    "loss_before",
    "accepted",
    "attempts",
    "gain_ratio",
    "step_norm",
    "status",
    "stop",
    "damping",
)


@dataclass
class DeviceOutcome:
    """What one capturable iteration did, on the device.

    ``x``: the point the iteration ends at (the old one, same values, when nothing
    was accepted); ``report``: the numbers of :data:`REPORT` in one float64 vector,
    so a user who reads them waits once.
    """

    x: Tensor
    accepted: Tensor
    stop: Tensor
    report: Tensor
    #: The state after the step, to be stored (:meth:`commit`) once nothing can fail.
    damping: Tensor
    nu: Tensor
    scale: Tensor | None

    def commit(self, state: DeviceDamping) -> None:
        """Store λ, ν and the running scale into ``state``, in place."""
        state.damping.copy_(self.damping)
        state.nu.copy_(self.nu)
        if self.scale is not None:
            if state.scale is None or state.scale.shape != self.scale.shape:
                state.scale = self.scale
            else:
                state.scale.copy_(self.scale)


def capture_refusal(
    *, solver: str, linalg_backend: str, geodesic: bool, damping_rule: str
) -> str | None:
    """Why these settings can never be captured (``None``: they can).

    The message names the setting, its value and what to use instead.
    """
    if linalg_backend != "torch":
        return (
            f"Invalid linalg_backend={linalg_backend!r} with capturable=True: that backend "
            "factors on the host; use linalg_backend='torch'."
        )
    if solver not in ("auto", "cholesky"):
        why = {
            "cg": "CG's iteration count depends on the data",
            "eigh": "torch.linalg.eigh waits for the host on CUDA",
            "qr": "the QR solver reads its failure flag on the host",
        }.get(solver, "it is not a device-resident solver")
        return (
            f"Invalid solver={solver!r} with capturable=True: {why}; use solver='cholesky' "
            "(or 'auto', which then means Cholesky)."
        )
    if geodesic:
        return (
            "Invalid geodesic=True with capturable=True: the acceleration's acceptance test "
            "is decided on the host; use geodesic=False."
        )
    if damping_rule not in ("nielsen", "multiplicative"):
        return (
            f"Invalid damping_rule={damping_rule!r} with capturable=True: use 'nielsen' or "
            "'multiplicative'."
        )
    return None


def _all_finite(system: NormalEquations) -> Tensor:
    """Whether the record holds finite numbers only, as a 0-d bool.

    ``0·t`` sums to 0 exactly when every entry of ``t`` is finite.  The Gram's
    diagonal is ``col_sq``, which covers J; without a Gram, ``col_sq`` does.
    """
    total = system.loss_sum * 0.0 + (system.grad * 0.0).sum()
    covering = system.gram if system.gram is not None else system.col_sq
    return (total + (covering * 0.0).sum()) == 0.0


def _moves(system: NormalEquations, finite: Tensor, gtol: float) -> Tensor:
    """Finite, and MINPACK's ``max |cos|`` between J's columns and r above ``gtol``.

    The measure of :meth:`NormalEquations.scalars` (0 when r or a column is zero).
    """
    rnorm = system.loss_sum.clamp(min=0.0).sqrt()
    colnorm = system.col_sq.sqrt()
    ratio = torch.where(colnorm > 0, system.grad.abs() / colnorm, 0.0).max() / rnorm
    return finite & (torch.where(rnorm > 0, ratio, 0.0) > gtol)


def _kept_scale(scale: Tensor | None, state: DeviceDamping, moves: Tensor) -> Tensor | None:
    """``scale`` where the point moves, else the stored one (zeros where none is yet).

    A zero scale is no scale: the next running maximum is the next linearisation's.
    """
    if scale is None:
        return None
    old = state.scale
    if old is None or old.shape != scale.shape:
        old = torch.zeros_like(scale)
    return torch.where(moves, scale, old)


def _sequence(
    rule: DampingRule, state: DeviceDamping, config: EngineConfig, count: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(λ, ν, over)``: the ``count + 1`` values a run of rejections visits from the state.

    Entry k is the state after k rejections (:func:`~.damping.raise_damping` with the
    engine's restart, then the maximum: ``over[k]`` marks a λ clamped to it).
    """
    lams, nus, overs = [state.damping], [state.nu], [torch.zeros_like(state.damping)]
    lam, nu = state.damping, state.nu
    for _ in range(count):
        lam, nu = rule.rejected(lam, nu)
        lam = torch.where(lam <= 0.0, config.damping_restart, lam).clamp(min=config.damping_min)
        overs.append((lam > config.damping_max).to(lam.dtype))
        lam = lam.clamp(max=config.damping_max)
        lams.append(lam)
        nus.append(nu)
    return torch.stack(lams), torch.stack(nus), torch.stack(overs)


def _solve(m: Tensor, shift: Tensor, b: Tensor) -> Tensor:
    """``(m + diag(shift))⁻¹ b`` by Cholesky, NaN where it failed, with no host read.

    On the CPU ``cholesky_solve``, as the default step solves (the same bits); on other
    devices two triangular solves, which launch no check of their own.
    """
    a = m.clone()
    a.diagonal().add_(shift)
    low, info = torch.linalg.cholesky_ex(a)
    rhs = b.to(m.dtype).unsqueeze(-1)
    if m.device.type == "cpu":
        y = torch.cholesky_solve(rhs, low)[:, 0]
    else:
        z = torch.linalg.solve_triangular(low, rhs, upper=False)
        y = torch.linalg.solve_triangular(low.mT, z, upper=True)[:, 0]
    return torch.where(info == 0, y, math.nan)


def _directions(
    system: NormalEquations,
    d: Tensor,
    lams: list[Tensor],
    dtype: torch.dtype,
    matrix_dtype: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """The steps ``(JᵀJ + λₖD)⁻¹(-Jᵀr)`` (NaN where Cholesky failed) and their ``Jδ``.

    The dual form solves ``(Js Jsᵀ + λₖI) yₖ = -r`` and has ``Jδₖ = Js Jsᵀ yₖ``, with
    ``Js Jsᵀ`` formed in ``matrix_dtype`` (the step's precision; ``None``: J's own); the
    primal form leaves ``Jδ`` to the Gram (``None``).  The default step's operations,
    one λ at a time.
    """
    deltas: list[Tensor] = []
    images: list[Tensor | None] = []
    if system.dual:
        assert system.jac is not None and system.residuals is not None
        rows = _ScaledRows(system.jac, d, matrix_dtype or system.jac.dtype)
        w = -system.residuals
        for lam in lams:
            y = _solve(rows.k, lam, w)
            deltas.append(rows.step(y).to(dtype))
            images.append(rows.image)
        return deltas, images
    gram = system.gram
    assert gram is not None, "the capturable step needs the Gram in the primal form"
    dg = d.to(gram.dtype)
    b = -system.grad
    for lam in lams:
        deltas.append(_solve(gram, lam * dg, b).to(dtype))
        images.append(None)
    return deltas, images


def _predicted(system: NormalEquations, delta: Tensor, image: Tensor | None) -> Tensor:
    """``-2gᵀδ - ‖Jδ‖²`` in float64, as :func:`~.measure.predicted_reduction` computes it.

    Without its power-of-two rescaling, which changes no bit unless ``‖Jδ‖²``
    overflows or underflows the Gram's dtype.
    """
    wide = torch.float64
    linear = torch.dot(system.grad.to(wide), delta.to(wide))
    if image is not None:
        curvature = torch.dot(image, image)
    else:
        assert system.gram is not None
        dg = delta.to(system.gram.dtype)
        curvature = torch.dot(dg, system.gram @ dg)
    return -2.0 * linear - curvature.to(wide)


def device_iteration(
    problem: Problem,
    x: Tensor,
    system: NormalEquations,
    *,
    rule: DampingRule,
    matrix: DampingMatrix,
    state: DeviceDamping,
    config: EngineConfig,
    reducer: Reducer,
    lr: float,
    candidates: int,
    matrix_dtype: torch.dtype | None = None,
) -> DeviceOutcome:
    """One LM iteration from ``x`` whose decisions are tensor operations (see the module).

    Nothing is written: ``x`` is not modified and :meth:`DeviceOutcome.commit` stores
    the new state (the caller does once the model is written).  The report's losses are
    means over the system's residual count.  ``matrix_dtype``: the dtype the dual
    matrix is formed in (the step's precision; the primal Gram comes formed).
    """
    count = max(system.count, 1)
    wide = torch.float64
    loss0 = system.loss_sum.to(wide)
    finite = _all_finite(system)
    moves = _moves(system, finite, config.gtol)
    col = system.col_sq if system.scale_sq is None else system.scale_sq
    scale = matrix.device_scale(col, state)
    d = matrix.device_diagonal(col if scale is None else scale, state, config.damping_min)
    # Moré's scale moves only where the default step would measure it: at a finite
    # point that the gtol test does not stop at.
    scale = _kept_scale(scale, state, moves)
    # Attempts past max_attempts are never reached: the default step stops before.
    candidates = min(candidates, config.max_attempts)
    if candidates == 1:
        head = _Head(
            problem, x, system, rule, state, config, reducer, lr, count, loss0, matrix_dtype
        )
        return _one_attempt(head, d, finite, moves, scale)
    lams, nus, overs = _sequence(rule, state, config, candidates)
    lam_list = list(lams[:candidates].unbind())
    steps, images = _directions(system, d, lam_list, x.dtype, matrix_dtype)
    if lr != 1.0:
        steps = [lr * v for v in steps]
        images = [None if im is None else lr * im for im in images]
    preds = [_predicted(system, v, im) for v, im in zip(steps, images, strict=True)]
    deltas, pred = torch.stack(steps), torch.stack(preds)
    if not reducer.is_identity:
        # Every rank solved the same summed system: take the root's numbers, so the
        # parameters stay bitwise identical across ranks.
        reducer.broadcast_([deltas, pred])
    tries = x + deltas
    loss1 = torch.stack([torch.as_tensor(problem.loss_sum(t)).to(wide) for t in tries])
    actual = loss0 - loss1
    rho = torch.where(pred > 0, actual / pred, -math.inf)
    evaluated = (loss1 - loss1) == 0  # finite trial loss (and δ: else it is NaN)
    accept = evaluated & (actual > 0) & (rho > config.min_gain_ratio)
    step_norm = torch.linalg.vector_norm(deltas.to(wide), dim=-1)
    xnorm = torch.linalg.vector_norm(x.to(wide))
    xnorm_try = torch.linalg.vector_norm(tries.to(wide), dim=-1)
    # Scipy's ftol and xtol tests (status 2, 3, 4), after every evaluated attempt.
    ftol = config.ftol * loss0
    ftol_hit = (actual.abs() <= ftol) & (pred <= ftol) & (rho <= 2.0)
    xtol_hit = step_norm <= config.xtol * (config.xtol + torch.where(accept, xnorm_try, xnorm))
    status = evaluated * (2.0 * ftol_hit + 3.0 * xtol_hit - (ftol_hit & xtol_hit).to(wide))
    over = overs[1:] > 0
    ends = accept | (status > 0) | (~accept & over)
    if candidates == config.max_attempts:
        ends[-1] = True  # attempts exhausted: the default step stops here too
    index = torch.arange(candidates, device=x.device)
    first = torch.where(ends, index, candidates).min()
    at = first.clamp(max=candidates - 1).reshape(1)
    took = ends.any() & accept.index_select(0, at)[0] & moves
    rho_at = rho.index_select(0, at)[0]
    # The gain ratio reported is the last evaluated attempt's, as the default step's.
    last = torch.where(evaluated & (index <= first), index, -1).max()
    rho_seen = torch.where(last >= 0, rho.index_select(0, last.clamp(min=0).reshape(1))[0], 0.0)
    lam_acc, nu_acc = rule.accepted(lams.index_select(0, at)[0], nus.index_select(0, at)[0], rho_at)
    after = (first + 1).clamp(max=candidates).reshape(1)
    lam_rej, nu_rej = lams.index_select(0, after)[0], nus.index_select(0, after)[0]
    # A point with non-finite numbers: rejected without a restart, within the bounds.
    lam_bad, nu_bad = rule.rejected(state.damping, state.nu)
    lam_bad = lam_bad.clamp(min=config.damping_min, max=config.damping_max)
    lam_new = torch.where(
        took, lam_acc.clamp(min=config.damping_min), torch.where(finite, lam_rej, lam_bad)
    )
    nu_new = torch.where(took, nu_acc, torch.where(finite, nu_rej, nu_bad))
    lam_new = torch.where(moves | ~finite, lam_new, state.damping)
    nu_new = torch.where(moves | ~finite, nu_new, state.nu)
    x_new = torch.where(took, tries.index_select(0, at)[0], x)
    status_at = torch.where(ends.any() & moves, status.index_select(0, at)[0], 0.0)
    gtol_hit = finite & ~moves
    status_at = torch.where(gtol_hit, 1.0, status_at)
    stop = gtol_hit | (moves & ends.any() & ~(took & (status_at == 0)))
    # As the default step counts: none when gtol held, one for a refused point.
    attempts = torch.where(moves, (first + 1).clamp(max=candidates).to(wide), (~finite).to(wide))
    report = torch.stack(
        [
            torch.where(took, loss1.index_select(0, at)[0], loss0) / count,
            loss0 / count,
            took.to(wide),
            attempts,
            torch.where(moves, rho_seen, torch.where(finite, 0.0, math.nan)),
            torch.where(took, step_norm.index_select(0, at)[0], 0.0),
            status_at,
            stop.to(wide),
            lam_new,
        ]
    )
    return DeviceOutcome(
        x=x_new, accepted=took, stop=stop, report=report, damping=lam_new, nu=nu_new, scale=scale
    )


@dataclass
class _Head:
    """What an iteration's attempts share."""

    problem: Problem
    x: Tensor
    system: NormalEquations
    rule: DampingRule
    state: DeviceDamping
    config: EngineConfig
    reducer: Reducer
    lr: float
    count: int
    loss0: Tensor
    matrix_dtype: torch.dtype | None


def _one_attempt(
    h: _Head, d: Tensor, finite: Tensor, moves: Tensor, scale: Tensor | None
) -> DeviceOutcome:
    """:func:`device_iteration` with one candidate: the same decisions, fewer operations."""
    wide, config, state, x, loss0 = torch.float64, h.config, h.state, h.x, h.loss0
    lam, nu = state.damping, state.nu
    (delta,), (image,) = _directions(h.system, d, [lam], x.dtype, h.matrix_dtype)
    if h.lr != 1.0:
        delta = h.lr * delta
        image = None if image is None else h.lr * image
    pred = _predicted(h.system, delta, image)
    if not h.reducer.is_identity:
        h.reducer.broadcast_([delta, pred.reshape(1)])
    x_try = x + delta
    loss1 = torch.as_tensor(h.problem.loss_sum(x_try)).to(wide)
    actual = loss0 - loss1
    rho = torch.where(pred > 0, actual / pred, -math.inf)
    evaluated = (loss1 - loss1) == 0  # finite trial loss (and δ: else it is NaN)
    accept = evaluated & (actual > 0) & (rho > config.min_gain_ratio)
    took = accept & moves
    x_new = torch.where(took, x_try, x)
    step_norm = torch.linalg.vector_norm(delta, dtype=wide)
    # Scipy's ftol and xtol tests (status 2, 3, 4) on the evaluated attempt.
    ftol = config.ftol * loss0
    ftol_hit = evaluated & (actual.abs() <= ftol) & (pred <= ftol) & (rho <= 2.0)
    xnorm = torch.linalg.vector_norm(torch.where(accept, x_try, x), dtype=wide)
    xtol_hit = evaluated & (step_norm <= config.xtol * (config.xtol + xnorm))
    status = torch.where(ftol_hit, torch.where(xtol_hit, 4.0, 2.0), torch.where(xtol_hit, 3.0, 0.0))
    lam_acc, nu_acc = h.rule.accepted(lam, nu, rho)
    raw, nu_rej = h.rule.rejected(lam, nu)
    lam_rej = torch.where(raw <= 0.0, config.damping_restart, raw).clamp(min=config.damping_min)
    over = lam_rej > config.damping_max
    # A point with non-finite numbers: rejected without a restart, within the bounds.
    lam_bad = raw.clamp(min=config.damping_min, max=config.damping_max)
    lam_new = torch.where(
        took,
        lam_acc.clamp(min=config.damping_min),
        torch.where(
            moves, lam_rej.clamp(max=config.damping_max), torch.where(finite, lam, lam_bad)
        ),
    )
    nu_new = torch.where(took, nu_acc, torch.where(moves | ~finite, nu_rej, nu))
    gtol_hit = finite & ~moves
    status = torch.where(gtol_hit, 1.0, torch.where(moves, status, 0.0))
    # With max_attempts=1 a rejection exhausts the attempts, as in the default step.
    exhausted = ~accept & (over | (config.max_attempts == 1))
    stop = gtol_hit | (moves & ((status > 0) | exhausted))
    report = torch.stack(
        [
            torch.where(took, loss1, loss0) / h.count,
            loss0 / h.count,
            took.to(wide),
            (~gtol_hit).to(wide),
            torch.where(moves & evaluated, rho, torch.where(finite, 0.0, math.nan)),
            torch.where(took, step_norm, 0.0),
            status,
            stop.to(wide),
            lam_new,
        ]
    )
    return DeviceOutcome(
        x=x_new, accepted=took, stop=stop, report=report, damping=lam_new, nu=nu_new, scale=scale
    )
