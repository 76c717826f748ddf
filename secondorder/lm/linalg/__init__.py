"""Linear algebra of one LM iteration: the normal-equation record and its solvers.

One module per concern: :mod:`.record` (:class:`NormalEquations`, what the stages
share), :mod:`.gram` (the symmetric products), :mod:`.base` (the solver interface:
factor once per iteration, solve for every λ), one module per solver, and
:mod:`.factory` above them.

Which solver to choose:

* ``"cholesky"`` (:mod:`.cholesky`): factor ``JᵀJ + λD`` (primal, n×n) or
  ``J D⁻¹Jᵀ + λI`` (dual, m×m) for each λ.  The fastest for moderate sizes.
* ``"eigh"`` (:mod:`.eigh`): one eigendecomposition per iteration; every retry with
  a new λ costs two matrix-vector products.  The most robust in float32.
* ``"qr"`` (:mod:`.qr`): a QR of J itself, so the condition number is that of J
  rather than its square (MINPACK's method); needs J stored.
* ``"cg"`` (:mod:`.cg`): matrix-free preconditioned conjugate gradients, products
  with J and Jᵀ only; for parameter counts whose n×n Gram does not fit.

``linalg_backend="numpy"`` or ``"cupynumeric"`` runs ``"cholesky"`` and ``"eigh"`` on
an array module instead of torch (:mod:`.backends`).
"""

from .base import Factorization, LinearSolver
from .broadcast import BroadcastSolver
from .cg import CGFactorization, CGSolver
from .cholesky import CholeskySolver
from .eigh import EighSolver
from .factory import SOLVERS, make_solver
from .gram import dual_blocks, gram_blocks, gram_update, symmetric_product
from .qr import QRSolver
from .record import HOST_MAX_N, HostArrays, NormalEquations

__all__ = [
    "HOST_MAX_N",
    "SOLVERS",
    "BroadcastSolver",
    "CGFactorization",
    "CGSolver",
    "CholeskySolver",
    "EighSolver",
    "Factorization",
    "HostArrays",
    "LinearSolver",
    "NormalEquations",
    "QRSolver",
    "dual_blocks",
    "gram_blocks",
    "gram_update",
    "make_solver",
    "symmetric_product",
]
