"""kfac-pytorch's ``KFACPreconditioner`` on top of :class:`secondorder.kfac.KFAC`.

Porting a KAISA script is one changed import::

    from secondorder.compat.kfac.preconditioner import KFACPreconditioner

and the loop stays ``loss.backward(); preconditioner.step(); optimizer.step()``.

What keeps KAISA's numbers: the factors are built from the gradients of the loss as it
is backpropagated (KAISA's convention; native ``so.KFAC`` rescales them to one sample),
so ``damping`` and ``kl_clip`` keep their KAISA values and the run matches KAISA's for
``nn.Linear`` layers (tested on one process against kfac-pytorch's own runs).  On W
ranks with equal shards, KAISA averages the ranks' factors, each built from the
gradient of its own mean loss; so does this class (tested on 2 gloo ranks against one
process on the concatenated batch whose loss is multiplied by W, gradients divided by
W: KAISA's effective damping shrinks as ranks are added).  With the eigen method and
``compute_eigenvalue_outer_product=True`` (KAISA's default) a scheduled ``damping``
is read at each decomposition and kept until the next, as KAISA folds it into
``1/(d_G d_Aᵀ + λ)`` then; with ``False`` it is read at every step, as in KAISA.
The same modules are preconditioned
(leaf ``nn.Linear`` and ``nn.Conv2d`` with every parameter trainable, ``skip_layers``
as regular expressions searched in the name and the class name).  Differences that
remain, on purpose:

* ``nn.Conv2d`` factors follow the KFC rule (Grosse & Martens 2016); KAISA divides the
  patch rows by the number ``P`` of output positions, so its A is ours / P² and its G
  ours / P³, and conv layers take different steps;
* a Linear layer whose input has extra dimensions (tokens) gets ``G`` summed over them
  per sample, where KAISA averages over them (its G is ours / T);
* a layer called several times in one forward (shared weights) pools the calls into
  one factor update, counting its samples once (the calls are more positions of them);
  KAISA folds each call into its running factors in turn, so such a layer takes
  different steps;
* eigendecompositions and inverses run in ``inv_dtype`` (KAISA always computes them in
  float32 and then casts);
* ``colocate_factors``, ``allreduce_bucket_cap_mb`` and ``update_factors_in_hook`` are
  accepted and change nothing (one rank decomposes both factors of a layer; all factors
  travel in one all-reduce; the factors are updated in ``step()``);
* ``skip_layers`` that leaves no layer to precondition is refused (KAISA builds a
  preconditioner that does nothing);
* a new ``factor_update_steps`` (a scheduler's) takes effect one step later than in
  KAISA, whose hooks read it at the next forward;
* a forward in training mode under ``torch.no_grad()`` (a metric) leaves the factors
  alone, as every forward that is not backpropagated does; KAISA's forward hook folds
  its input into A, and applies ``factor_decay`` once more;
* with gradient accumulation, micro-batches of different sizes weigh by their samples
  (the statistics are summed, then divided by the samples); KAISA averages the
  micro-batches' factors, each weighing the same (equal micro-batches agree);
* ``kl_clip=None`` (no clipping) is accepted, and a layer without a gradient keeps it
  with a warning; KAISA refuses the first and fails on the second.

For new code, use :class:`secondorder.kfac.KFAC`: its per-sample factors do not change
with the batch size or the number of ranks.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..._keywords import check_keywords
from ...kfac import KFAC
from ...kfac.checkpoint import check_counters
from ...kfac.loading import PreparedLoad, commit_load, prepare_load
from .arguments import check_scheduled, kaisa_modules, native_fraction
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, parse

__all__ = ["KAISAConventionWarning", "KFACPreconditioner"]

logger = logging.getLogger(__name__)

#: Hyperparameters KAISA lets be a number or a callable of the step.
SCHEDULED = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")

#: Options of kfac-pytorch's other preconditioners that this class does not take.
KAISA_ELSEWHERE = {
    "assignment": "pass assignment_strategy='compute' or 'memory' instead of a WorkAssignment.",
    "tdc": "communication goes through torch.distributed's default group; pass nothing.",
    "defaults": "it is bookkeeping of kfac-pytorch's base class; pass nothing.",
    "data_parallel_group": "GPT-NeoX's model parallelism is not supported; use DDP.",
    "model_parallel_group": "GPT-NeoX's model parallelism is not supported; use DDP.",
    "pipeline_parallel_group": "GPT-NeoX's pipeline parallelism is not supported; use DDP.",
    "factor_checkpoint_dir": "save state_dict() with torch.save instead.",
}


class KAISAConventionWarning(UserWarning):
    """Emitted when a :class:`KFACPreconditioner` is built: it names KAISA's scaling."""


CONVENTION = (
    "secondorder.compat.kfac.KFACPreconditioner keeps kfac-pytorch's scaling: K-FAC's G "
    "factor is built from the gradient of the loss as you backpropagate it, which for a "
    "mean loss over a per-rank batch of B samples is so.KFAC's per-sample G divided by "
    "B² (so KAISA's effective damping changes with the batch size and the number of "
    "ranks); damping and kl_clip keep their kfac-pytorch values. For new code use "
    "so.KFAC, whose factors do not depend on B: its damping=B²·damping and "
    "kl_clip=B²·kl_clip reproduce this run once the identity start of the factors has "
    "decayed and while the KL clip is active."
)


class KFACPreconditioner:
    """kfac-pytorch 0.4.2's ``KFACPreconditioner`` (KAISA), run by :class:`~secondorder.kfac.KFAC`.

    Every argument of kfac-pytorch's constructor is taken, with its defaults, its enums
    (:mod:`secondorder.compat.kfac.enums`) and their string spellings; see the module
    docstring for what is converted and what differs.  The native preconditioner is
    :attr:`kfac`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Callable[[int], int] | int = 1,
        inv_update_steps: Callable[[int], int] | int = 1,
        damping: Callable[[int], float] | float = 0.001,
        factor_decay: Callable[[int], float] | float = 0.95,
        kl_clip: Callable[[int], float] | float = 0.001,
        lr: Callable[[int], float] | float = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: list[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        **unknown: Any,
    ) -> None:
        check_keywords(
            "KFACPreconditioner", unknown, _keywords(type(self)), KAISA_ELSEWHERE,
            "kfac-pytorch (KAISA)",
        )  # fmt: skip
        values = {
            "factor_update_steps": factor_update_steps,
            "inv_update_steps": inv_update_steps,
            "damping": damping,
            "factor_decay": factor_decay,
            "kl_clip": kl_clip,
            "lr": lr,
        }
        for name, value in values.items():
            check_scheduled(name, value)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(f"Invalid accumulation_steps={accumulation_steps!r}: must be an int.")
        if accumulation_steps < 1:
            raise ValueError(f"Invalid accumulation_steps={accumulation_steps!r}: must be >= 1.")
        if not isinstance(allreduce_bucket_cap_mb, (int, float)) or allreduce_bucket_cap_mb < 0:
            raise ValueError(
                f"Invalid allreduce_bucket_cap_mb={allreduce_bucket_cap_mb!r}: must be >= 0."
            )
        method = parse("compute_method", ComputeMethod, compute_method)
        strategy = parse("assignment_strategy", AssignmentStrategy, assignment_strategy)
        if (
            method is ComputeMethod.EIGEN
            and compute_eigenvalue_outer_product
            and not (colocate_factors)
        ):
            raise ValueError(
                "Invalid colocate_factors=False with compute_eigenvalue_outer_product=True: "
                "the outer product of the eigenvalues needs both factors of a layer on one "
                "rank; set colocate_factors=True (kfac-pytorch refuses this pair too)."
            )
        fraction, distributed = native_fraction(grad_worker_fraction)
        if skip_layers is None:
            skip_layers = []
        if isinstance(skip_layers, str) or not all(isinstance(s, str) for s in skip_layers):
            raise TypeError(
                f"Invalid skip_layers={skip_layers!r}: must be a list of regular expressions "
                "matched against module names and class names, e.g. ['fc3', 'Linear']."
            )
        try:
            for pattern in skip_layers:
                re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"Invalid skip_layers entry {pattern!r}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")

        for name, value in values.items():
            setattr(self, "_" + name, value)
        self._accumulation_steps = accumulation_steps
        self._update_factors_in_hook = update_factors_in_hook
        self._loglevel = loglevel
        self._f_steps: dict[int, int] = {}
        # KAISA divides by d_G d_Aᵀ + λ when it decomposes (the eigen method with
        # compute_eigenvalue_outer_product): λ is frozen until the next decomposition
        self._freezes_damping = method is ComputeMethod.EIGEN and compute_eigenvalue_outer_product
        self._frozen_damping: float | None = None
        self.allreduce_bucket_cap_mb = float(allreduce_bucket_cap_mb)
        self.assignment_strategy = strategy
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.compute_method = method
        self.distributed_strategy = distributed
        self.grad_scaler = grad_scaler
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.skip_layers = list(skip_layers)
        self.symmetry_aware = symmetry_aware

        #: The native preconditioner that does the work.
        self.kfac = KFAC(
            model,
            factor_update_steps=self._scheduled_factor_steps,
            inv_update_steps=lambda s: self._at("inv_update_steps", s),
            damping=self._scheduled_damping,
            factor_decay=lambda s: self._at("factor_decay", s),
            kl_clip=self._scheduled_kl_clip,
            lr=lambda s: self._at("lr", s) or 1.0,  # lr = 0: no clip (see kl_clip)
            accumulation_steps=accumulation_steps,
            compute_method=method.name.lower(),
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            modules=_modules(model, self.skip_layers),
            grad_worker_fraction=fraction,
            assignment_strategy=strategy.name.lower(),
            symmetry_aware=symmetry_aware,
            # the loss is taken as it is backpropagated: KAISA's factor scale
            loss_reduction="sum",
            grad_scaler=grad_scaler,
        )
        self.grad_worker_fraction = (
            self.kfac.assignment.grad_workers / self.kfac.assignment.world_size
        )
        for name, layer in self.kfac.layers.items():
            logger.log(loglevel, f'Registered name="{name}": {layer!r}')
        warnings.warn(CONVENTION, KAISAConventionWarning, stacklevel=2)

    # -- hyperparameters, KAISA's properties -------------------------------------------
    def _at(self, name: str, step: int, values: dict[str, Any] | None = None) -> Any:
        value = values[name] if values and name in values else getattr(self, "_" + name)
        return value(step) if callable(value) else value

    def _scheduled_factor_steps(self, step: int) -> int:
        # so.KFAC reads the interval of step s+1 at the end of step s (to decide whether
        # the next forward is captured) and again at step s+1: both reads must agree
        if step not in self._f_steps:
            self._f_steps = {s: v for s, v in self._f_steps.items() if s >= step - 1}
            self._f_steps[step] = self._at("factor_update_steps", step)
        return self._f_steps[step]

    def _scheduled_damping(self, step: int) -> float:
        # KAISA's eigen method with compute_eigenvalue_outer_product=True (its default)
        # folds λ into 1/(d_G d_Aᵀ + λ) at each decomposition: a λ scheduled between two
        # decompositions takes effect at the next one, as it does here
        value = float(self._at("damping", step))
        if not self._freezes_damping:
            return value
        if self._frozen_damping is None or step % self._at("inv_update_steps", step) == 0:
            self._frozen_damping = value
        return self._frozen_damping

    def _scheduled_kl_clip(self, step: int) -> float | None:
        # KAISA's clip with lr = 0 divides by a zero sum and keeps the step (scale 1)
        if self._at("lr", step) == 0:
            return None
        value: float | None = self._at("kl_clip", step)
        return value

    @property
    def steps(self) -> int:
        """The number of :meth:`step` calls so far."""
        return self.kfac.steps

    @property
    def damping(self) -> float:
        """Damping at the current step."""
        return float(self._at("damping", self.steps))

    @property
    def factor_decay(self) -> float:
        """Running-average weight of the factors at the current step."""
        return float(self._at("factor_decay", self.steps))

    @property
    def kl_clip(self) -> float | None:
        """KL clip at the current step."""
        value = self._at("kl_clip", self.steps)
        return None if value is None else float(value)

    @property
    def lr(self) -> float:
        """The learning rate the KL clip assumes, at the current step."""
        return float(self._at("lr", self.steps))

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, at the current step."""
        return int(self._at("factor_update_steps", self.steps))

    @property
    def inv_update_steps(self) -> int:
        """Steps between decompositions, at the current step."""
        return int(self._at("inv_update_steps", self.steps))

    # -- the step ----------------------------------------------------------------------
    def step(self) -> None:
        """Precondition every registered layer's ``.grad``; call before ``optimizer.step()``."""
        with torch.no_grad():
            self.kfac.step()

    def reset_batch(self) -> None:
        """Forget the statistics gathered since the last factor update."""
        for layer in self.kfac.layers.values():
            layer.reset_stats()

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by KAISA's keys, and their ``total``.

        ``a_factors``/``g_factors``: the factors; ``a_batch``/``g_batch``: the statistics
        gathered since the last factor update; ``a_inverses``/``g_inverses``: this
        rank's decompositions of A and of G (eigenvectors and eigenvalues, or inverses).
        """
        keys = ("a_factors", "g_factors", "a_batch", "g_batch", "a_inverses", "g_inverses")
        sizes = dict.fromkeys(keys, 0)
        for layer in self.kfac.layers.values():
            held = [("a_factors", layer.A), ("g_factors", layer.G)]
            held += [("a_batch", layer.a_sum), ("g_batch", layer.g_sum)]
            # QA, dA, A_inv, A_chol belong to A; QG, dG, G_inv, G_chol to G
            held += [("a_inverses" if "A" in k else "g_inverses", t) for k, t in layer.inv.items()]
            for key, t in held:
                if t is not None:
                    sizes[key] += t.nelement() * t.element_size()
        sizes["total"] = sum(sizes.values())
        return sizes

    def __repr__(self) -> str:
        params = {
            "accumulation_steps": self._accumulation_steps,
            "allreduce_bucket_cap_mb": self.allreduce_bucket_cap_mb,
            "assignment_strategy": self.assignment_strategy,
            "colocate_factors": self.colocate_factors,
            "compute_method": self.compute_method,
            "distributed_strategy": self.distributed_strategy,
            "grad_worker_fraction": self.grad_worker_fraction,
            "layers": len(self.kfac.layers),
            "steps": self.steps,
            **{name: getattr(self, "_" + name) for name in SCHEDULED},
        }
        body = "\n".join(f"  {k}={v}," for k, v in sorted(params.items()))
        return f"{type(self).__name__}(\n{body}\n)"

    # -- state -------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """kfac-pytorch's state: ``steps``, the constant hyperparameters and each layer's A, G.

        A layer's factors are ``(n, n)`` tensors (a grouped convolution's, ``(groups, n,
        n)``), None before the first factor update.
        """
        state: dict[str, Any] = {"steps": self.steps}
        for name in SCHEDULED:
            value = getattr(self, "_" + name)
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = {
                name: {"A": _kaisa_shape(layer.A), "G": _kaisa_shape(layer.G)}
                for name, layer in self.kfac.layers.items()
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`'s output (or kfac-pytorch's); checked before anything is set.

        With ``compute_inverses`` the decompositions are recomputed from the loaded
        factors, at the loaded hyperparameters, so training can resume at any step.  If
        the state is refused on any rank, every rank raises and nothing changes.
        """
        prepared: PreparedLoad | None = None
        error: BaseException | None = None
        hyper: dict[str, Any] = {}
        layers = None
        frozen: float | None = None
        # preparing reads the schedules at the loaded step, which caches their values
        own = ["_" + name for name in SCHEDULED] + ["_f_steps", "_frozen_damping"]
        old = {name: getattr(self, name) for name in own}
        old["_f_steps"] = dict(self._f_steps)

        def undo() -> None:
            for name, value in old.items():
                setattr(self, name, value)

        try:
            if not isinstance(state_dict, dict) or "steps" not in state_dict:
                raise ValueError("KFACPreconditioner.load_state_dict: expected a dict with 'steps'")
            hyper = {name: state_dict[name] for name in SCHEDULED if name in state_dict}
            for name, value in hyper.items():
                check_scheduled(name, value)
            native = self.kfac.state_dict()
            native["steps"] = state_dict["steps"]
            layers = state_dict.get("layers")
            if layers is not None:
                if not isinstance(layers, dict) or len(layers) != len(self.kfac.layers):
                    raise ValueError(
                        "KFACPreconditioner.load_state_dict: the state holds "
                        f"{len(layers) if isinstance(layers, dict) else layers!r} layers, "
                        f"this model {len(self.kfac.layers)}"
                    )
                native["layers"] = {
                    name: self._native_entry(name, entry) for name, entry in layers.items()
                }
            check_counters(native)  # the step count, before it is used below
            steps = int(native["steps"])
            # the decompositions of the loaded step, at the loaded hyperparameters (as
            # KAISA sets them before it recomputes), assigned only after the agreement
            frozen = float(self._at("damping", steps, hyper))
            uses = int(self._at("inv_update_steps", steps, hyper))
            recompute = compute_inverses and layers is not None
            prepared = prepare_load(self.kfac, native, recompute, frozen, uses)
        except BaseException as exc:
            error = exc
        what = "KFACPreconditioner load_state_dict"
        try:
            self.kfac._agree_load(error, what)
        except BaseException:
            undo()
            raise
        assert prepared is not None

        def after() -> None:
            for name, value in hyper.items():
                setattr(self, "_" + name, value)
            self._f_steps = {}
            self._frozen_damping = frozen

        commit_load(self.kfac, prepared, what, after, undo)
        if layers is None and compute_inverses:
            warnings.warn(
                "Layer factors are not included in the state_dict, so the decompositions "
                "cannot be recomputed; they are recomputed at the next inverse update.",
                stacklevel=2,
            )

    def _native_entry(self, name: str, entry: Any) -> dict[str, Any]:
        if name not in self.kfac.layers:
            raise ValueError(
                f"KFACPreconditioner.load_state_dict: layer {name!r} is not one of this "
                f"model's K-FAC layers {sorted(self.kfac.layers)}"
            )
        if not isinstance(entry, dict) or "A" not in entry or "G" not in entry:
            raise KeyError(f"KFACPreconditioner state of layer {name!r} must have keys 'A' and 'G'")
        a, g = entry["A"], entry["G"]
        if a is None or g is None:
            return {"inv": {}}
        a_shape, g_shape = self.kfac.layers[name].factor_shapes()
        out: dict[str, Any] = {"inv": {}}
        for key, t, shape in (("A", a, a_shape), ("G", g, g_shape)):
            # (n, n) as KAISA saves it, or (groups, n, n): the same numbers in another
            # shape are another layer's (a grouped convolution's blocks are no matrix)
            shapes = [tuple(shape)] + ([tuple(shape[1:])] if shape[0] == 1 else [])
            if not isinstance(t, Tensor) or tuple(t.shape) not in shapes:
                raise ValueError(
                    f"KFACPreconditioner state of layer {name!r}: factor {key} must be a "
                    f"tensor of shape {shapes[-1]}, got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}; "
                    "the checkpoint is of another model."
                )
            out[key] = t.reshape(shape)
        return out


def _keywords(cls: type) -> list[str]:
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _kaisa_shape(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t[0].clone() if t.shape[0] == 1 else t.clone()


def _modules(model: nn.Module, skip_layers: list[str]) -> list[str]:
    """KAISA's modules, refused with ``skip_layers`` named when none is left."""
    names = kaisa_modules(model, skip_layers)
    if not names and skip_layers and kaisa_modules(model, []):
        raise ValueError(
            f"Invalid skip_layers={skip_layers!r}: it skips every trainable Linear and "
            "Conv2d layer of the model, so nothing would be preconditioned (kfac-pytorch "
            "builds a preconditioner that does nothing). Drop the pattern that matches "
            "them all, or leave out the preconditioner for this model."
        )
    return names
