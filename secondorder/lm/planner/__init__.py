r"""Memory planning: how many bytes one LM step needs, decided before any is allocated.

An LM step goes through stages whose sizes follow from shapes alone.  With ``n``
parameters, ``m`` residual rows, ``s`` samples per Jacobian slice, ``k`` rows per
sample, ``b`` bytes per parameter entry and ``g`` bytes per entry of the Gram's dtype:

========================  ==========================================================
stage                     bytes (what is alive at its peak)
========================  ==========================================================
Jacobian slice            ``2·s·k·n·b`` (the strategy's per-parameter blocks and the
                          flattened copy) plus, with several slices, the previous
                          slice and its copy in the Gram's dtype; forward mode adds
                          its tangents, whole-batch modes their cotangents
Gram ``JᵀJ``              ``n²·g`` (primal form, Cholesky or eigh)
stored rows of J          ``m·n·b``, twice while the slices are concatenated (dual
                          form, QR, CG)
dual matrix               ``J D^-½`` (``m·n·g``) and ``J D⁻¹Jᵀ`` (``m²·g``)
factorisation             Cholesky ``3n²·g`` (damped copy, factor, LAPACK's copy),
                          eigh ``4n²·g`` (scaled matrix, eigenvectors, workspace),
                          dual ``3m²·g``, QR the factors of J and of the per-λ stack
CG vectors                nine n-vectors and an m-vector
trial evaluation          the residuals and activations of one slice
finite check              ``(itemsize + 3)`` bytes per entry of the Gram or of J
                          (``|x|`` and three boolean masks)
========================  ==========================================================

The constants (3 and 4 for the factorisations, 3 bytes for the check) were measured
on CPU (LAPACK through torch); with them the peak resident memory of whole steps
agrees with the estimate to within a few percent (``tests/test_planner.py`` checks
25%).  The whole-step peak is the larger of two phases: *linearise* (vectors, the
Gram, the stored rows, one slice being computed or the rows being concatenated,
then the finiteness check) and *solve* (vectors, the Gram or the rows, the dual
matrix, the factorisation, CG vectors and one trial evaluation).

What is not modelled: memory the framework keeps for itself (the CUDA context, the
caching allocator's fragmentation), the model's own buffers, and the model's
activations, which only :func:`plan_memory`'s ``activations`` argument describes (one
number, the entries a sample saves for backward, from :func:`activation_numel`);
among them the trial's forward pass that :class:`~secondorder.lm.carry.ForwardCarry`
keeps for the next step, with a copy of the inputs (one slice, and only while the plan
pools J's rows).
:class:`~secondorder.lm.LevenbergMarquardt` passes 0: it evaluates the model only
on the schedule of a step.  For per-sample reverse mode, the default, activations
are small next to J (a sample's k rows of J hold k·n numbers; its activations, the
widths of its layers).  Forward mode and the whole-batch modes push n tangents or
m cotangents through the activations, so for them the estimate is a lower bound.
That is also why a measured free memory is used only up to :data:`USABLE_FRACTION`.

Why plan at all: a Gram of ``n = 10⁵`` parameters is 80 GB in float64, and a
per-sample forward-mode Jacobian materialises ``n²`` numbers per sample.  Finding
that out from an out-of-memory error in the middle of a step wastes the work done so
far; the planner finds it from the shapes, picks the largest slice that fits, lets
``solver="auto"`` fall back to matrix-free CG, and otherwise raises
:class:`PlanError` naming the options that would fit.

:func:`plan_memory` is a pure function of shapes, dtypes and options, so a plan can
be computed for a machine you do not have (pass ``available``) and tested without
allocating anything.
"""

from ..memory import activation_numel, available_memory
from ..stages import Stage
from .plan import MemoryPlan, PlanError
from .rules import DIRECT_SOLVE_LIMIT
from .search import USABLE_FRACTION, available_range, plan_memory

__all__ = [
    "DIRECT_SOLVE_LIMIT",
    "USABLE_FRACTION",
    "MemoryPlan",
    "PlanError",
    "Stage",
    "activation_numel",
    "available_memory",
    "available_range",
    "plan_memory",
]
