"""Checking a strategy on a probe of the batch, and the coupling checks.

Does a strategy reproduce the whole batch's residuals and Jacobian?  Samples that
interact, and models ``vmap`` cannot run, make it fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .program import JacobianStrategy, Params, ResidualProgram, _VmapReverse

#: Samples a strategy is checked on (once per input signature): enough for samples to
#: interact, few enough that the check costs about one step on eight samples.
PROBE_SAMPLES = 8


class ResidualsIndependentError(ValueError):
    """The residuals do not depend on the model's trainable parameters."""


@dataclass(frozen=True)
class Reference:
    """The whole-batch evaluation a strategy is checked against.

    Attributes:
        residuals: ``r`` of the probe, evaluated on the whole probe at once.
        weights: one weight per residual, ``±{½, 1, 2}`` (fixed seed, not all equal).
        weighted_grad: ``Σᵢ wᵢ ∂rᵢ/∂θ`` by one backward pass of the whole probe.
        repeatable: whether a second evaluation gave the same residuals (not the case
            with Dropout in training mode or another random operation).
    """

    residuals: Tensor
    weights: Tensor
    weighted_grad: Tensor
    repeatable: bool


def _close(a: Tensor, b: Tensor, scale: Tensor) -> Tensor:
    """``‖a - b‖∞ ≤ √ε · scale`` (a 0-d bool): rounding passes, a coupling term does not."""
    eps = torch.finfo(a.dtype).eps
    return (a - b).abs().max() <= eps**0.5 * scale + torch.finfo(a.dtype).tiny


def _tracked(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> tuple[Params, Tensor]:
    """The residuals of the whole slice at leaves that require grad, and the leaves.

    Raises :class:`ResidualsIndependentError` when they carry no gradient.
    """
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        r = program.batch(leaves, inputs, targets)
    if not r.requires_grad:
        call = (
            "residual_fn(model(inputs), targets)"
            if program.per_sample is not None
            else "the ModelResidual's fn(model, inputs, targets)"
        )
        raise ResidualsIndependentError(
            "the residuals do not depend on the model's trainable parameters: "
            f"{call} returned a tensor with no gradient (requires_grad=False), so J "
            "would be zero and the fit would stop at once with a false convergence. "
            "residual_fn must compute its output from the model's output with torch "
            "operations (no .detach(), .item(), .numpy() or torch.no_grad())."
        )
    return leaves, r


def batch_reference(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> Reference:
    """Evaluate the probe as one batch: two forward passes and one backward pass.

    Raises :class:`ResidualsIndependentError` when the residuals carry no gradient to
    the parameters (a ``residual_fn`` that detaches, or that computes through NumPy or
    ``.item()``): no Jacobian strategy could be right.
    """
    leaves, r = _tracked(program, params, inputs, targets)
    gen = torch.Generator().manual_seed(0)
    w = 2.0 ** torch.randint(-1, 2, (r.numel(),), generator=gen).double()
    w = w * (1 - 2 * torch.randint(0, 2, (r.numel(),), generator=gen)).double()
    if r.numel() > 1:
        w[0], w[1] = 1.0, -0.5  # never all equal: a constant weight hides a mean's term
    w = w.to(r)
    total = torch.autograd.grad(
        (r * w).sum(), [leaves[k] for k in program.order], allow_unused=True
    )
    flat = torch.cat(
        [
            # An Embedding(sparse=True) gives a sparse gradient.
            (
                torch.zeros_like(leaves[k]) if t is None else t.to_dense() if t.is_sparse else t
            ).reshape(-1)
            for k, t in zip(program.order, total, strict=True)
        ]
    )
    with torch.enable_grad():
        # Evaluated as the first was (a residual_fn may branch on grad mode).
        again = program.batch(leaves, inputs, targets).detach()
    r = r.detach()
    scale = r.abs().max() if r.numel() else torch.zeros((), dtype=r.dtype)
    # Non-finite numbers decide nothing: such a probe counts as repeatable.
    repeatable = again.shape != r.shape or bool(
        ~torch.isfinite(r).all() | ~torch.isfinite(again).all() | _close(again, r, scale)
    )
    return Reference(r, w, flat.detach(), repeatable)


@dataclass(frozen=True)
class ProbeVerdict:
    """What checking one strategy on a probe found.

    ``status`` is ``"ok"``; ``"coupled"`` (the strategy ran but its residuals or rows
    differ from the whole-batch evaluation: samples interact); ``"failed"`` (it
    raised; ``detail`` holds the error); or ``"undecided"`` (non-finite numbers, which
    decide nothing: the next batch of the signature is checked again).
    """

    status: str
    detail: str = ""
    #: What the strategy raised (``"failed"`` only).
    error: Exception | None = field(default=None, compare=False, repr=False)


def check_strategy(
    strategy: JacobianStrategy,
    program: ResidualProgram,
    params: Params,
    inputs: Any,
    targets: Any,
    reference: Reference,
) -> ProbeVerdict:
    """Run ``strategy`` on the probe and compare it with the whole-batch ``reference``.

    The residuals must match the batch evaluation and ``Jᵀw`` must match
    ``Σᵢ wᵢ ∂rᵢ/∂θ``, both to ``√ε`` of their scale: a per-sample strategy on samples
    that interact (a residual minus the batch mean, a module computing
    ``x - x.mean(0)``, ``F.batch_norm(training=True)``) misses the cross-sample terms
    and fails.  Costs the strategy on the probe and one host synchronisation.
    """
    try:
        jac, r = strategy(program, params, inputs, targets)
    except CouplingError as exc:  # the outer-product rule's own check saw the interaction
        return ProbeVerdict("coupled", exc.detail)
    except Exception as exc:  # any failure means "not this strategy"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProbeVerdict("failed", f"{type(exc).__name__}: {first[:300]}", exc)
    ref = reference
    if r.shape != ref.residuals.shape:
        return ProbeVerdict(
            "coupled",
            f"{r.numel()} residuals sample by sample against {ref.residuals.numel()} "
            "for the whole probe",
        )
    w = ref.weights.to(jac.dtype)
    jw = jac.T @ w
    finite = (
        torch.isfinite(r).all()
        & torch.isfinite(ref.residuals).all()
        & torch.isfinite(jw).all()
        & torch.isfinite(ref.weighted_grad).all()
    )
    same_r = _close(r, ref.residuals, ref.residuals.abs().max())
    scale = torch.maximum((jac.abs().T @ w.abs()).max(), ref.weighted_grad.abs().max())
    same_j = _close(jw, ref.weighted_grad.to(jw.dtype), scale)
    finite_h, same_r_h, same_j_h = torch.stack([finite, same_r, same_j]).tolist()
    if not finite_h:
        return ProbeVerdict("undecided")
    if not same_r_h:
        return ProbeVerdict("coupled", "the residuals differ from the whole batch's")
    if not same_j_h:
        return ProbeVerdict("coupled", "the Jacobian's rows differ from the whole batch's")
    return ProbeVerdict("ok")


def _refuse_coupling(program: ResidualProgram, params: Params, inputs: Any, targets: Any) -> None:
    """Raise if the outer-product rule failed its check because samples interact.

    The rule's rows disagree with autograd either because a weight is used outside
    its layer (``vmap`` is then right) or because samples interact, which ``vmap``
    gets just as wrong.  Compare ``vmap``'s rows with the whole slice evaluated at
    once (two evaluations and one backward pass, once per signature) and raise in
    the second case.
    """
    reference = batch_reference(program, params, inputs, targets)
    verdict = check_strategy(_VmapReverse(), program, params, inputs, targets, reference)
    if verdict.status == "coupled":
        raise CouplingError("reverse", verdict.detail)


class CouplingError(ValueError):
    """A per-sample strategy met samples that interact (see :func:`coupling_message`)."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(coupling_message(name, detail))
        self.detail = detail


def coupling_message(name: str, detail: str) -> str:
    """The error for a per-sample strategy on samples that interact."""
    return (
        f"jacobian={name!r} would compute a wrong Jacobian: {detail} when the samples are "
        "evaluated one at a time, so the samples of this batch interact (a residual_fn "
        "that subtracts a batch mean, a module computing x - x.mean(0), "
        "F.batch_norm(training=True), ...). Use jacobian='batch_reverse' or "
        "'batch_forward', or 'auto', which checks and switches to them."
    )
