"""Jacobian strategies: how the rows of J for one slice of the batch are computed.

All strategies return the same thing, ``(J, r)`` for a slice: J of shape
``(residuals in the slice, parameters)`` and the residuals themselves, and all are
tested against :func:`torch.func.jacrev` of the whole residual vector.  They differ in
cost:

* ``"reverse"`` (per-sample reverse mode): one backward pass per residual of a
  sample, all samples at once.  Cost grows with the number of residuals *per sample*
  (1 for a scalar regression or for cross-entropy through the square-root trick) and
  not with the parameter count: the usual choice.  When every trainable parameter
  belongs to an ``nn.Linear`` layer, the rows are assembled from one batched forward
  pass and one backward pass per residual of a sample: the gradient of a sample's
  residual with respect to a layer's weight is the outer product of the gradient at
  the layer's output and the layer's input, ``∂rᵢ/∂W = gᵢ aᵢᵀ``, written straight into
  J (about the cost of one forward plus backward pass).  ``nn.Conv1d``/``nn.Conv2d``
  layers join the rule with their im2col patches in place of ``aᵢ`` (summed over
  output positions; :mod:`secondorder.lm.conv_rows`).  Otherwise ``vmap`` over
  ``vjp`` computes the same rows, more slowly (its batched outer products run as
  many tiny matrix products).
* ``"forward"`` (per-sample forward mode, ``vmap`` over ``jvp``): one forward pass per
  parameter.  Wins only when a sample has more residuals than the model has
  parameters (small models with large outputs).
* ``"batch_reverse"`` / ``"batch_forward"``: differentiate the residual vector of
  the whole slice at once.  Needed when samples interact (BatchNorm in training mode
  normalises with batch statistics, so a per-sample Jacobian would be wrong) and for
  :class:`~secondorder.lm.residuals.ModelResidual`.  Reverse costs one backward per
  residual of the slice, forward one forward per parameter; the cheaper is taken
  under ``"auto"``.

Per-sample strategies assume each sample's residuals depend on that sample only.
``"auto"`` checks its candidates on a probe of the batch and falls back to a
whole-batch mode; a strategy the user forced is wrapped in :class:`CheckedStrategy`,
which runs the same check once per input signature and raises instead of switching.

One module per concern: :mod:`.program` (what a strategy differentiates),
:mod:`.strategies` (the five strategies), :mod:`.outer` (the outer-product rule),
:mod:`.factors` (``Jᵀr``, ``diag(JᵀJ)`` and ``J Jᵀ`` from a layer's factors),
:mod:`.recording` (the layers' calls of a forward pass, a trial's pass kept),
:mod:`.probes` (checking a strategy on a probe of the batch) and :mod:`.checked`
(a forced strategy checked where it runs).
"""

from .checked import CheckedStrategy, random_message, unsupported_message
from .factors import FactorGram, RowProducts, RowSums
from .outer import outer_product_layers
from .probes import (
    PROBE_SAMPLES,
    CouplingError,
    ProbeVerdict,
    Reference,
    ResidualsIndependentError,
    batch_reference,
    check_strategy,
    coupling_message,
)
from .program import JacobianStrategy, Params, ResidualProgram
from .recording import record_trial
from .strategies import (
    JACOBIANS,
    BatchForward,
    BatchReverse,
    PerSampleForward,
    PerSampleReverse,
    make_jacobian,
)

__all__ = [
    "JACOBIANS",
    "PROBE_SAMPLES",
    "BatchForward",
    "BatchReverse",
    "CheckedStrategy",
    "CouplingError",
    "FactorGram",
    "JacobianStrategy",
    "Params",
    "PerSampleForward",
    "PerSampleReverse",
    "ProbeVerdict",
    "Reference",
    "ResidualProgram",
    "ResidualsIndependentError",
    "RowProducts",
    "RowSums",
    "batch_reference",
    "check_strategy",
    "coupling_message",
    "make_jacobian",
    "outer_product_layers",
    "random_message",
    "record_trial",
    "unsupported_message",
]
