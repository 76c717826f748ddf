"""The least-squares problem of one batch: linearise at x, evaluate trial points.

:class:`ModelProblem` is what :func:`secondorder.lm.engine.iterate` drives.  It is
built for one batch from a :class:`~secondorder.lm.model.ModelFunction` (the model as a
function of x) and a :class:`BatchSetup` (the batch and the choices made for it:
Jacobian strategy, solver, form, slice size, Gram dtype).  Its only state is the
residual count of each slice at the last linearisation, against which every trial
point is checked (a residual function whose output size changes between the two
would otherwise compare losses over different residuals), and the denominator of the
reported loss where that is not the count (:mod:`.loss_mean`).  ``linearize`` walks the
batch slice by slice, reduces the slices' sums into one
:class:`~secondorder.lm.linalg.NormalEquations` record (through the reducer, the only
stage that talks to other processes), and keeps J's rows only where the dual form or
the solver needs them.  The geodesic acceleration's ``r_vv`` is :mod:`.geodesic`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import Reducer
from ..distributed.devices import DeviceGroup
from .geodesic import second_directional
from .jacobian import FactorGram, JacobianStrategy, ResidualProgram, record_trial
from .kfac_cg import kronecker_stats
from .linalg import LinearSolver, NormalEquations, gram_update
from .model import ModelEvaluator, ModelFunction, slice_tree
from .precision import StepPrecision

__all__ = ["BatchSetup", "ModelProblem"]


@dataclass(frozen=True)
class BatchSetup:
    """One batch and what was chosen for it (see :class:`~secondorder.lm.choices.Choices`).

    Attributes:
        inputs, targets: the batch (``targets`` may be ``None``).
        batch_size: samples in ``inputs``.
        slice_size: samples per Jacobian slice.
        strategy: how J's rows are computed.
        solver: factors and solves the damped normal equations.
        form: ``"primal"`` (n×n ``JᵀJ``) or ``"dual"`` (m×m ``JD⁻¹Jᵀ``).
        precision: the dtype the Gram is accumulated in (``None``: the parameters')
            and its float32 row chunks (:func:`~secondorder.lm.linalg.gram_update`).
        dual_scale: whether ``linearize`` measures the scale of ``JD⁻¹Jᵀ`` (dual form
            under ``gram_dtype="auto"``).
        pool_rows: whether J's rows go into a buffer kept for the next step (the
            memory plan's ``pooled_rows``).
    """

    inputs: Any
    targets: Any
    batch_size: int
    slice_size: int
    strategy: JacobianStrategy
    solver: LinearSolver
    form: str
    precision: StepPrecision
    dual_scale: bool
    pool_rows: bool = True


@dataclass
class _Sums:
    """What the slices of one linearisation add up to, before the cross-rank reduction."""

    loss_sum: Tensor
    grad: Tensor
    col_sq: Tensor
    grams: list[Tensor | None]
    jacs: list[Tensor]
    res: list[Tensor]
    count: int = 0
    #: ``J Jᵀ`` from the outer-product rule's factors (one slice, device and process).
    outer: FactorGram | None = None


class ModelProblem:
    """The residuals of one batch as functions of a flat x (the engine's ``Problem``)."""

    def __init__(self, function: ModelFunction, setup: BatchSetup) -> None:
        self.function = function
        self.setup = setup
        self.store_rows = setup.form == "dual" or setup.solver.needs_jacobian
        #: Whether J's rows stay with the participant that computed them (CG, whose
        #: products the reducer sums); otherwise ``linearize`` gathers every
        #: participant's rows (the dual form, QR: the identity on one process).
        self.rows_sharded = self.store_rows and setup.solver.row_shards
        #: Whether ``linearize`` computes the K-FAC factors (CG with ``"kfac"``).
        self.needs_kronecker = setup.solver.needs_kronecker
        #: Residuals of each slice at the last linearisation (this rank's), and their sum.
        self.slice_counts: list[int] | None = None
        #: The denominator of the reported loss where it is not the residual count
        #: (cross-entropy, :mod:`.loss_mean`): ``None``, or its rule and, at the last
        #: linearisation, its value over every rank (0-d float64 on the solver device).
        self.loss_mean = function.loss_mean
        self.weight_sum: Tensor | None = None

    # -- what the batch was set up with, by name ----------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The model's trainable parameters, in the order of x."""
        return self.function.params

    @property
    def names(self) -> list[str]:
        """The parameters' names, in the order of x."""
        return self.function.names

    @property
    def n(self) -> int:
        """Number of unknowns (columns of J)."""
        return self.function.n

    @property
    def program(self) -> ResidualProgram:
        """The user's model's residual program, what a Jacobian strategy differentiates."""
        return self.function.program

    @property
    def reducer(self) -> Reducer:
        """Sums partial results across ranks."""
        return self.function.reducer

    @property
    def group(self) -> DeviceGroup:
        """The devices slices are computed on and the solver device."""
        return self.function.group

    @property
    def replicas(self) -> list[ModelEvaluator]:
        """One evaluator per device entry."""
        return self.function.replicas

    @property
    def strategy(self) -> JacobianStrategy:
        """How J's rows are computed for this batch."""
        return self.setup.strategy

    @property
    def solver(self) -> LinearSolver:
        """The linear solver of this batch."""
        return self.setup.solver

    @property
    def form(self) -> str:
        """``"primal"`` or ``"dual"``."""
        return self.setup.form

    @property
    def gram_dtype(self) -> torch.dtype | None:
        """The dtype the Gram is accumulated in (``None``: the parameters')."""
        return self.setup.precision.dtype

    @property
    def slice_size(self) -> int:
        """Samples per Jacobian slice."""
        return self.setup.slice_size

    def unflatten(self, x: Tensor) -> dict[str, Tensor]:
        """The flat vector ``x`` as a name → tensor dict of parameter-shaped views."""
        return self.function.unflatten(x)

    def batch_residuals(self, params: dict[str, Tensor], inputs: Any, targets: Any) -> Tensor:
        """The flat residuals of ``(inputs, targets)`` at ``params`` on the user's model."""
        return self.function.home.batch(params, inputs, targets)

    def slices(self) -> Iterator[tuple[Any, Any]]:
        """The batch's slices as ``(inputs, targets)`` pairs, in order."""
        setup = self.setup
        if self._one_slice():
            yield setup.inputs, setup.targets
            return
        step = setup.slice_size
        for start in range(0, setup.batch_size, step):
            stop = min(start + step, setup.batch_size)
            targets = slice_tree(setup.targets, start, stop) if setup.targets is not None else None
            yield slice_tree(setup.inputs, start, stop), targets

    def _local(self) -> bool:
        """Whether the batch is one slice on one device of one process (no one to reduce with)."""
        return self._one_slice() and len(self.group) == 1 and self.reducer.is_identity

    def _one_slice(self) -> bool:
        """Whether the batch is linearised as one slice.

        Samples that interact (or a residual that needs the model itself) are never
        sliced; a slice as large as the batch is the batch itself (no views to make).
        """
        setup = self.setup
        return not setup.strategy.per_sample or setup.slice_size >= setup.batch_size

    # -- the Problem protocol -----------------------------------------------------------
    def linearize(self, x: Tensor) -> NormalEquations:
        """``Σr²``, ``Jᵀr``, ``diag(JᵀJ)`` and the Gram or J's rows at ``x``, all ranks summed."""
        counts: list[int] = []
        error: Exception | None = None
        # The program a kept forward pass belongs to (one slice: the first device's).
        carry = self.replicas[0].program.carry
        try:
            sums = self._accumulate(x, counts)
        except Exception as exc:
            # The other ranks are on their way into the reduction below: join it with
            # zeros of the same shapes and a failure flag, so that every rank raises
            # and the process group stays in step for the next call (a caller that
            # catches the error and goes on would otherwise meet a collective of
            # another size and break the group).  Alone, the error is raised here.
            error = self.reducer.hold(exc)
            sums = self._zero_sums(x)
        self.slice_counts = counts
        gram = self.group.sum(sums.grams)
        col_sq = sums.col_sq
        if gram is not None:
            # diag(JᵀJ) comes free with the Gram.
            col_sq = gram.diagonal().to(x.dtype).clone()
        wide = torch.float64
        weight_sum = None
        if self.loss_mean is not None:
            # Summed over every slice and rank, as the loss is: the mean is the batch's.
            weight_sum = (
                self.loss_mean.total(self.setup.targets, sums.count, x.device)
                if error is None
                else torch.zeros((), dtype=wide, device=x.device)
            )
        if self.reducer.is_identity:
            # Alone: nothing to sum, and an error is raised as it is.
            self.reducer.raise_together(error, 0.0, "linearising")
            loss_sum, count = sums.loss_sum, sums.count
        else:
            # The residual count travels with the loss: exact in float64 below 2⁵³
            # entries.  torch.full fills on the device; torch.tensor would copy from
            # the host, and a copy from pageable host memory makes a GPU wait.
            tally = torch.stack(
                [
                    sums.loss_sum,
                    torch.full((), float(sums.count), dtype=wide, device=x.device),
                    torch.full((), float(error is not None), dtype=wide, device=x.device),
                ]
                + ([] if weight_sum is None else [weight_sum])
            )
            self.reducer.sum_([tally, sums.grad, col_sq] + ([gram] if gram is not None else []))
            self.reducer.raise_together(error, tally[2], "linearising")
            loss_sum, count = tally[0], self.reducer.total(sums.count, tally[1])
            weight_sum = None if weight_sum is None else tally[3]
        self.weight_sum = weight_sum
        jac, residuals = self._rows(sums)
        dual = self.form == "dual"
        dual_scale = None
        if self.setup.dual_scale and dual and jac is not None:
            # The mean diagonal entry of J diag(col_sq)⁻¹ Jᵀ: its trace, the count of
            # nonzero columns, over the number of rows.  No pass over J.
            tiny = torch.finfo(col_sq.dtype).tiny
            dual_scale = (col_sq > tiny).sum().to(torch.float64) / max(jac.shape[0], 1)
        fields: dict[str, Any] = {
            "factor_gram": sums.outer if dual else None,
            "loss_sum": loss_sum,
            "grad": sums.grad,
            "col_sq": col_sq,
            "gram": gram,
            "jac": jac,
            "residuals": residuals,
            "dual": dual,
            "dual_scale": dual_scale,
            "kronecker": kronecker_stats(self, x) if self.needs_kronecker else None,
        }
        # A kept forward pass exists only on one process (see loss_sum).
        check = None if carry is None else carry.check
        system = NormalEquations(
            count=count,
            weight_sum=weight_sum,
            carry_check=check,
            reducer=self.reducer,
            rows_sharded=self.rows_sharded,
            **fields,
        )
        if carry is not None and check is not None:
            carry.check = None
            system.scalars()  # the check rides with the loss: no read of its own
            if not system.carry_valid:
                # The kept pass's point or inputs no longer hold its values (written
                # through .data, or memory shared with NumPy): again, without it
                # (take() has dropped it).
                carry.stale()
                return self.linearize(x)
        return system

    def _accumulate(self, x: Tensor, counts: list[int]) -> _Sums:
        """Walk the slices: their J and r, summed on the solver device in slice order.

        Appends each slice's residual count to ``counts``.
        """
        group, n, wide = self.group, self.n, torch.float64
        # One slice (a batch holds a sample at least): its sums are assigned, not
        # added to zeros, and ``x`` holds the places until they are.
        one = self._one_slice()
        sums = _Sums(
            loss_sum=x if one else torch.zeros((), dtype=wide, device=x.device),
            grad=x if one else torch.zeros(n, dtype=x.dtype, device=x.device),
            col_sq=x if one else torch.zeros(n, dtype=x.dtype, device=x.device),
            # One partial Gram per device entry, summed on the solver device at the end.
            grams=[None] * len(group),
            jacs=[],
            res=[],
        )
        store = self.store_rows
        # One slice on one device of one process: the stored rows' J Jᵀ may come from
        # the layers' factors, and a Gram is that of [J r], which gives Jᵀr with JᵀJ
        # (the rows' pooled buffer holds r as a last column).
        setup = self.setup
        local = self._local()
        points = self.function.points(x)
        for replica in self.replicas:
            replica.program.rows_pool.keep = self.setup.pool_rows
        with self.function.frozen():
            for k, inputs, targets in group.stage(self.slices()):
                with group.on(k):
                    program = self.replicas[k].program
                    carry = program.carry
                    if carry is not None:
                        carry.begin()
                    J, r = self.strategy(program, points[k], inputs, targets)
                    if carry is not None:
                        carry.discard()
                    # Jᵀr and diag(JᵀJ) from the layers' factors when the outer-product
                    # rule wrote these rows, else a pass over J each.
                    products = program.row_products.take(
                        J, col_sq=store, outer=store and local, augmented=not store and local
                    )
                    J = J.detach()
                    r = r.detach()
                    sums.count += r.numel()
                    counts.append(r.numel())
                    r_wide = r.to(wide)
                    part_loss = torch.dot(r_wide, r_wide)
                    sums.outer = None if products is None else products.outer
                    grad = None if products is None else products.grad
                    augmented = None if products is None else products.augmented
                    if augmented is not None:
                        full = gram_update(None, augmented, self.gram_dtype, setup.precision.chunk)
                        sums.grams[k] = full[:n, :n]
                        part_grad = full[:n, n].to(x.dtype)
                    else:
                        part_grad = J.T @ r if grad is None else grad
                    if store:
                        col = None if products is None else products.col_sq
                        part_col = (J * J).sum(0) if col is None else col
                    elif augmented is None:
                        sums.grams[k] = gram_update(
                            sums.grams[k], J, self.gram_dtype, setup.precision.chunk
                        )
                # The vectors are added on the solver device in slice order, as one
                # device would add them.
                if one:
                    # One slice: its sums are the sums (0 + v is v).  The vectors may
                    # live in buffers the next slice or step writes: copied.
                    sums.loss_sum = group.gather(part_loss)
                    sums.grad = group.gather(part_grad).clone()
                    if store:
                        sums.col_sq = group.gather(part_col).clone()
                else:
                    sums.loss_sum += group.gather(part_loss)
                    sums.grad += group.gather(part_grad)
                    if store:
                        sums.col_sq += group.gather(part_col)
                if store:
                    sums.jacs.append(group.gather(J))
                    sums.res.append(group.gather(r))
                # Let go of this slice's rows before the next is computed: the
                # outer-product rule then writes that one into the same pooled buffer.
                del J, r, products, augmented
        return sums

    def _zero_sums(self, x: Tensor) -> _Sums:
        """Sums of no slice: what a rank whose slices raised brings to the reduction."""
        n, wide, group = self.n, torch.float64, self.group
        grams: list[Tensor | None] = [None] * len(group)
        if not self.store_rows:
            grams[0] = torch.zeros(n, n, dtype=self.gram_dtype or x.dtype, device=x.device)
        return _Sums(
            loss_sum=torch.zeros((), dtype=wide, device=x.device),
            grad=torch.zeros(n, dtype=x.dtype, device=x.device),
            col_sq=torch.zeros(n, dtype=x.dtype, device=x.device),
            grams=grams,
            jacs=[],
            res=[],
        )

    def _rows(self, sums: _Sums) -> tuple[Tensor | None, Tensor | None]:
        """J's stored rows and their residuals (every rank's where they must be gathered)."""
        if not self.store_rows:
            return None, None
        jac = sums.jacs[0] if len(sums.jacs) == 1 else torch.cat(sums.jacs)
        residuals = sums.res[0] if len(sums.res) == 1 else torch.cat(sums.res)
        if not self.rows_sharded:
            # The dual form and QR need every row of J: gather them, residuals riding
            # along, in rank order (the order of the global batch).
            jac, residuals = self.reducer.gather_rows_together([jac, residuals])
        return jac, residuals

    def loss_sum(self, x: Tensor) -> Tensor:
        """``Σ r²`` at ``x`` over the whole batch and every rank, in float64 (0-d).

        Raises :class:`ValueError` when a slice's residual count differs from the one
        at the last :meth:`linearize` (on any rank: every rank raises).  The check
        reads only shapes, so it costs no host synchronisation on one process; with
        several, the counts ride with the loss.
        """
        group = self.group
        points = self.function.points(x)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        expected = self.slice_counts
        seen: list[int] = []
        error: Exception | None = None
        # A batch the last two linearisations saw is likely seen again: the trial's
        # forward pass is kept for the next one (ForwardCarry), on one slice, device
        # and process, while the memory plan keeps buffers between steps.
        program = self.replicas[0].program
        carry = program.carry if self._local() and self.setup.pool_rows else None
        record = carry is not None and carry.armed
        try:
            with torch.no_grad(), self.function.frozen():
                for k, inputs, targets in group.stage(self.slices()):
                    with group.on(k):
                        if record:
                            r = record_trial(program, points[k], inputs, targets, x)
                        else:
                            r = self.replicas[k].batch(points[k], inputs, targets)
                        r = r.to(torch.float64)
                        seen.append(r.numel())
                        part = torch.dot(r, r)
                    total += group.gather(part)
        except Exception as exc:
            # As in linearize: join the reduction.
            error, seen = self.reducer.hold(exc), list(expected or [])
        # Every rank must learn that one rank's count changed, or the others would
        # wait for it in the next collective: the mismatch rides with the loss.
        mismatch = expected is not None and seen != expected
        total, (flag, trial, before, failed) = self.reducer.sum_with_values(
            total,
            [
                float(mismatch),
                float(sum(seen)),
                float(sum(expected or seen)),
                float(error is not None),
            ],
        )
        self.reducer.raise_together(error, failed, "evaluating a trial point")
        if flag > 0:
            raise ValueError(self._count_message(int(before), int(trial)))
        return total

    @staticmethod
    def _count_message(before: int, trial: int) -> str:
        return (
            f"residual_fn returned {trial} residuals at a trial point but {before} at the "
            "linearisation of the batch (same batch, same samples): the number of residuals "
            "must not depend on the parameters. Make residual_fn return the same shape for "
            "every parameter value (e.g. mask with zeros instead of dropping entries). "
            "Nothing was changed."
        )

    def second_directional(
        self, x: Tensor, v: Tensor, system: NormalEquations
    ) -> tuple[Tensor, Tensor | None]:
        """``(Jᵀr_vv, r_vv)``: :func:`~secondorder.lm.geodesic.second_directional`."""
        return second_directional(self, x, v, system)
