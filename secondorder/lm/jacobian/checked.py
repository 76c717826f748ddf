"""A strategy the user forced, checked where it runs (:class:`CheckedStrategy`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from .probes import PROBE_SAMPLES, CouplingError, _tracked, batch_reference, check_strategy
from .program import JacobianStrategy, Params, ResidualProgram, _signature


# -- checking a strategy the user forced ------------------------------------------------------
def random_message(name: str, model: nn.Module) -> str:
    """The error for residuals that differ between two evaluations (Dropout in training)."""
    dropouts = [
        path or type(m).__name__
        for path, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p
    ]
    where = f" (Dropout in training mode: {dropouts})" if dropouts else ""
    return (
        f"jacobian={name!r}: the residuals differ between two evaluations of the same "
        f"batch at the same parameters{where}. LM compares the loss of one batch before "
        "and after a step, so a random model makes it accept and reject at random: call "
        "model.eval() (or set the dropout probability to 0) for the LM steps, or pass "
        "jacobian='batch_reverse' to step anyway, with a new random draw at every evaluation."
    )


def _vmap_blockers(model: nn.Module, name: str) -> list[str]:
    """Modules per-sample ``vmap`` cannot run in mode ``name``, as ``'path' (Kind)``."""
    found = []
    for path, m in model.named_modules():
        label, kind = repr(path or type(m).__name__), type(m).__name__
        if isinstance(m, nn.RNNBase):
            found.append(f"{label} ({kind})")
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            if m.max_norm is not None:
                found.append(f"{label} ({kind}(max_norm={m.max_norm}))")
            elif m.sparse and name == "reverse":  # forward mode never forms the sparse grad
                found.append(f"{label} ({kind}(sparse=True))")
    return found


def unsupported_message(name: str, model: nn.Module, detail: str) -> str:
    """The error for a per-sample strategy that raised on a probe the batch evaluates."""
    blockers = _vmap_blockers(model, name)
    cause = (
        f"torch.func.vmap cannot run its module(s) {', '.join(blockers)} sample by sample"
        if blockers
        else (
            "it raised sample by sample where the whole batch evaluated at once did not "
            "(samples that interact, such as F.batch_norm(training=True), or an operation "
            "torch.func.vmap cannot run)"
        )
    )
    whole = "batch_forward" if name == "forward" else "batch_reverse"
    other = "batch_reverse" if name == "forward" else "batch_forward"
    return (
        f"jacobian={name!r} cannot compute this model's per-sample Jacobian: {cause} "
        f"({detail}). Use jacobian={whole!r} (or {other!r}), which differentiates the "
        "whole batch at once, or 'auto', which checks and switches. Nothing was changed."
    )


def _leading_size(tree: Any) -> int:
    leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.ndim]
    return int(leaves[0].shape[0]) if leaves else 0


def _head(tree: Any, size: int) -> Any:
    """The first ``size`` samples of every tensor in ``tree``."""
    return tree_map(lambda t: t[:size] if isinstance(t, Tensor) and t.ndim else t, tree)


class CheckedStrategy(JacobianStrategy):
    """A strategy the user forced, checked on the first slice of each input signature.

    ``jacobian="auto"`` checks its candidates itself and switches; a forced strategy
    runs as asked, but raises (during the linearisation, so the step changes nothing)
    where its Jacobian would be wrong:

    * per-sample (``"reverse"``, ``"forward"``): the strategy runs on a probe of the
      slice's first :data:`PROBE_SAMPLES` samples and is compared with the probe
      evaluated at once (:func:`check_strategy`, as ``"auto"`` does).  Samples that
      interact raise :class:`CouplingError`; a model ``vmap`` cannot run (GRU/LSTM,
      ``Embedding(max_norm=...)``) a ``ValueError`` naming the module and the
      whole-batch modes; a random model (Dropout in training) and residuals that
      ignore the parameters their own errors.  Cost, once per signature: the strategy
      on the probe and two evaluations of it (three calls of ``residual_fn``).
    * whole-batch: a slice whose J is exactly zero (one host synchronisation, once)
      is evaluated once more with autograd on, and residuals that carry no gradient
      raise :class:`ResidualsIndependentError` instead of a false convergence.

    The check is local to this rank and calls no collective: a rank that raises
    makes every rank raise through the linearisation's failure flags.
    """

    def __init__(self, inner: JacobianStrategy, model: nn.Module) -> None:
        self.inner = inner
        self.model = model
        self.name = inner.name
        self.per_sample = inner.per_sample

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        key = f"{self.name}|{_signature(inputs, targets)}"
        done = program.checked.get(key, 0)
        size = min(_leading_size(inputs), PROBE_SAMPLES)
        # A probe of one sample shows no interaction: a larger slice is probed again.
        probe = self.per_sample and done < 2 and size > done
        if probe and self._probe(program, params, inputs, targets, size):
            program.checked[key] = size
        jac, r = self.inner(program, params, inputs, targets)
        if not self.per_sample and key not in program.checked:
            if not bool(jac.any()):
                _tracked(program, params, inputs, targets)  # raises if r ignores θ
            program.checked[key] = 1
        return jac, r

    def _probe(
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any, size: int
    ) -> bool:
        """Check the strategy on ``size`` samples; whether the check decided (finite numbers)."""
        p_in = _head(inputs, size)
        p_t = _head(targets, size) if program.targets_batched else targets
        reference = batch_reference(program, params, p_in, p_t)
        if not reference.repeatable:
            raise ValueError(random_message(self.name, self.model))
        verdict = check_strategy(self.inner, program, params, p_in, p_t, reference)
        if verdict.status == "coupled":
            raise CouplingError(self.name, verdict.detail)
        if verdict.status == "failed":
            raise ValueError(
                unsupported_message(self.name, self.model, verdict.detail)
            ) from verdict.error
        return verdict.status == "ok"
