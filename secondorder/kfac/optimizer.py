"""K-FAC + SGD with momentum in one object, for a two-line start."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._keywords import check_keywords
from .._validation import check_number
from .agreement import OtherRankError, agree
from .config import KAISA, KAISA_OPTIONS
from .damping import LMDampingRule
from .loading import PreparedLoad, commit_load, prepare_load
from .preconditioner import KEYWORDS, KFAC
from .transaction import Snapshot

#: KFACOptimizer's own keywords, besides those of KFAC it passes on.
OWN = (
    "lr",
    "momentum",
    "weight_decay",
    "nesterov",
    "dampening",
    "adaptive_damping",
    "damping_adaptation_interval",
    "damping_adaptation_decay",
    "min_damping",
    "max_damping",
)

__all__ = ["KFACOptimizer"]


class KFACOptimizer(torch.optim.SGD):
    """SGD (with momentum) on K-FAC-preconditioned gradients; a ``torch.optim.SGD``.

    ``step()`` runs :meth:`KFAC.step` (which rewrites ``.grad``) and then SGD's step,
    so ``KFACOptimizer(model, lr=0.1, momentum=0.9)`` equals ``KFAC(model, lr=0.1)``
    followed by ``torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)``.
    The KL clip uses this optimizer's ``lr`` (the first group's).  ``step(closure)``
    calls ``closure`` under ``torch.enable_grad()`` and returns its loss, as
    ``torch.optim.SGD`` does.

    Adaptive damping (``adaptive_damping=True``) gives the closure another meaning:
    every ``damping_adaptation_interval`` steps, ``step(closure)`` evaluates
    ``closure()`` (the loss of the current batch, forward only; it is called under
    ``torch.no_grad()``, after the backward that made ``.grad``) before and after the
    update and returns the first; on the other steps the closure is not called
    (and ``step`` returns None).  λ is adapted by
    :class:`~secondorder.kfac.damping.LMDampingRule` from the ratio of the actual to
    the predicted reduction ``∇ᵀδ + ½δᵀ(A⊗G + λI)δ`` (plain-gradient
    parameters contribute ``∇ᵀδ + ½λ‖δ‖²``).  The new λ applies to the next step.
    On several ranks the closure's losses (one per shard) are averaged across them.

    Args:
        model: the model.
        lr, momentum, weight_decay, nesterov, dampening: as ``torch.optim.SGD``.
        adaptive_damping: adapt λ by the LM rule (needs a closure on adaptation steps).
        damping_adaptation_interval, damping_adaptation_decay, min_damping, max_damping:
            the rule's settings.
        **kfac_kwargs: every other argument of :class:`KFAC` (``damping``, ``kl_clip``...).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        dampening: float = 0.0,
        *,
        adaptive_damping: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.95,
        min_damping: float = 1e-8,
        max_damping: float = 1e8,
        **kfac_kwargs: Any,
    ) -> None:
        valid = [*OWN, *(k for k in KEYWORDS if k != "lr")]
        check_keywords("KFACOptimizer", kfac_kwargs, valid, KAISA_OPTIONS, KAISA)
        # torch.optim.SGD lets NaN and inf through (and a string fails on a comparison).
        check_number("lr", lr, at_least=0)
        check_number("momentum", momentum, at_least=0)
        check_number("weight_decay", weight_decay, at_least=0)
        check_number("dampening", dampening, at_least=0)
        self.rule = (
            LMDampingRule(
                damping_adaptation_interval, damping_adaptation_decay, min_damping, max_damping
            )
            if adaptive_damping
            else None
        )
        super().__init__(
            model.parameters(),
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            dampening=dampening,
        )
        self.kfac = KFAC(model, lr=lambda _: self.param_groups[0]["lr"], **kfac_kwargs)
        #: the last reduction ratio ρ of adaptive damping (None before the first).
        self.last_rho: float | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Precondition the gradients, then take the SGD step; see the class docstring.

        Without adaptive damping, ``closure`` is ``torch.optim``'s: it is called once,
        under ``torch.enable_grad()``, before the step (it zeroes the gradients, runs
        the forward and backward and returns the loss), and its loss is returned.

        The step is all or nothing: if it raises (a K-FAC refusal, an error or a Ctrl-C
        in SGD's update or in the closure's second call), the parameters, SGD's state
        and K-FAC's (factors, step count, ``.grad``, λ) are as before it, on every rank.
        To undo SGD's update, the step copies the parameters it updates and their
        momentum buffers (K-FAC's part reuses the copy of ``.grad`` it makes anyway).
        """
        adapt = self.rule is not None and self.kfac.steps % self.rule.interval == 0
        if adapt and closure is None:
            raise ValueError(
                "adaptive_damping needs step(closure) on adaptation steps: a closure that "
                "returns the loss of the current batch (forward only)"
            )
        if adapt:
            assert closure is not None
            return self._adaptive_step(closure)
        loss: Any = None
        error: BaseException | None = None
        if closure is not None and self.rule is None:
            # before anything changes; an error is raised on every rank by K-FAC's
            # first agreement, so no rank waits in a collective for this one
            try:
                with torch.enable_grad():
                    loss = closure()
            except BaseException as exc:
                error = exc
        undo = _StepUndo(self, self._stepped())
        try:
            self.kfac._step(error, undo.kfac)
            try:
                super().step()
            except BaseException as exc:
                error = exc
            # the ranks learn whether SGD's part failed anywhere, and undo it together
            agree(self.kfac.reducer, error, {}, self.kfac._device, "KFACOptimizer step")
        except BaseException:
            undo.restore(self)
            raise
        return loss

    def _adaptive_step(self, closure: Callable[[], Any]) -> Any:
        assert self.rule is not None
        params = self._stepped()
        loss_before = self._global_loss(closure)
        raw = [p.grad.clone() for p in params if p.grad is not None]  # all of _stepped()
        # what the step changes, so that anything failing after it (a closure, an
        # interrupt, on any rank) leaves the parameters, SGD's state, K-FAC's and λ
        # as they were, on every rank
        undo = _StepUndo(self, params)
        before = [b for _, b in undo.params]
        last_rho = self.last_rho
        try:
            self.kfac._step(None, undo.kfac)
            error: BaseException | None = None
            try:
                super().step()
            except BaseException as exc:
                error = exc
            loss_after = self._global_loss(closure, error)
            deltas = {p: p.detach() - b for p, b in zip(params, before, strict=True)}
            predicted = self._predicted(params, raw, deltas)
            rho = self.rule.ratio(loss_before, loss_after, predicted)
            damping = self.rule.update(self.kfac.damping, rho)
            self.last_rho = rho
            self.kfac.damping_override = damping
        except BaseException:
            undo.restore(self)
            self.last_rho = last_rho
            raise
        return loss_before

    def _stepped(self) -> list[Tensor]:
        """The parameters SGD's step updates: those with a gradient."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _global_loss(self, closure: Callable[[], Any], error: BaseException | None = None) -> float:
        # Each rank's closure gives its shard's loss; λ is decided from their mean
        # (the loss of the global batch for equal shards), so every rank adapts it
        # alike (K-FAC refuses a step whose λ differs between ranks).  A closure that
        # raises on one rank (or an ``error`` of the step before it) sends a flag in
        # the same sum: every rank raises.
        value = 0.0
        if error is None:
            try:
                value = float(closure())
            except BaseException as exc:
                error = exc
        reducer = self.kfac.reducer
        if reducer.world_size == 1:
            if error is not None:
                raise error
            return value
        row = [value, 0.0] if error is None else [0.0, 1.0]
        both = torch.tensor(row, dtype=torch.float64, device=self.kfac._device)
        reducer.sum_([both])
        if error is not None:
            raise error
        failed = int(both[1])
        if failed:
            raise OtherRankError(
                f"KFACOptimizer's closure raised on {failed} of {reducer.world_size} ranks "
                "(see the error there); every rank raises with it, and the parameters, "
                "SGD's state and K-FAC's are as before this step on every rank."
            )
        return float(both[0]) / reducer.world_size

    def _predicted(
        self, params: list[Tensor], raw: list[Tensor], deltas: dict[Tensor, Tensor]
    ) -> float:
        lam = self.kfac.damping
        lin = sum(
            float((g.double() * deltas[p].double()).sum()) for p, g in zip(params, raw, strict=True)
        )
        sq = sum(float(d.double().pow(2).sum()) for d in deltas.values())
        curv = 0.0
        for layer in self.kfac.layers.values():
            ps = layer.params()
            if not all(p in deltas for p in ps) or layer.A is None:
                continue
            saved = [p.grad for p in ps]
            # reuse the layer's gradient layout for the step: (groups, o, i)
            for p in ps:
                p.grad = deltas[p]
            d = layer.grad()
            for p, s in zip(ps, saved, strict=True):
                p.grad = s
            assert d is not None
            curv += float(layer.curvature(d))
        out = lin + 0.5 * (curv + lam * sq)
        return out if math.isfinite(out) else math.inf

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``{"state", "param_groups"}`` plus ``"kfac"``: :meth:`KFAC.state_dict`."""
        state = super().state_dict()
        state["kfac"] = self.kfac.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: both parts or neither, on every rank.

        Both parts are checked and prepared before K-FAC's is assigned; if either is
        refused on any rank (or a rank is interrupted), every rank raises with SGD's and
        K-FAC's state as they were.
        """
        state = dict(state_dict)
        kfac_state = state.pop("kfac", None)
        old_state, old_groups = self.state, self.param_groups
        prepared: PreparedLoad | None = None
        error: BaseException | None = None
        try:
            if kfac_state is None:
                raise ValueError(
                    "KFACOptimizer.load_state_dict: the state_dict has no 'kfac' entry"
                )
            prepared = prepare_load(self.kfac, kfac_state, recompute=False)
            # torch.optim checks the groups, then replaces self.state and
            # self.param_groups by new objects: putting the old ones back undoes it
            super().load_state_dict(state)
        except BaseException as exc:
            error = exc

        def undo() -> None:
            self.state, self.param_groups = old_state, old_groups

        try:
            self.kfac._agree_load(error, "KFACOptimizer load_state_dict")
        except BaseException:
            undo()
            raise
        assert prepared is not None
        commit_load(self.kfac, prepared, "KFACOptimizer load_state_dict", undo=undo)


class _StepUndo:
    """What a step changes: the parameters SGD updates, their state (momentum), and K-FAC.

    The parameters' and state's values are copied; ``kfac`` receives K-FAC's own
    snapshot from :meth:`KFAC._step` before it writes.  :meth:`restore` writes all of
    them back into the same tensors and state dicts, and forgets the state that the
    step created.
    """

    def __init__(self, opt: torch.optim.Optimizer, params: list[Tensor]) -> None:
        self.params = [(p, p.detach().clone()) for p in params]
        self.kfac: list[Snapshot] = []
        self.state: dict[Tensor, tuple[dict[str, Any], dict[str, Any]]] = {}
        for p in params:
            if p in opt.state:
                st = opt.state[p]
                copies = {k: v.clone() for k, v in st.items() if isinstance(v, Tensor)}
                self.state[p] = (dict(st), copies)

    def restore(self, opt: KFACOptimizer) -> None:
        """Put the parameters, their SGD state and K-FAC's state back."""
        for p, values in self.params:
            p.detach().copy_(values)
            if p not in self.state:
                opt.state.pop(p, None)
                continue
            items, copies = self.state[p]
            for k, v in copies.items():
                items[k].copy_(v)
            st = opt.state[p]
            st.clear()
            st.update(items)
        for snapshot in self.kfac:
            snapshot.restore(opt.kfac)
