"""``Shampoo``: the torch.optim.Optimizer that wires the parts together.

Blocking, preconditioner, grafting and distribution live in their own modules; this
one holds only the order of the stages and torch's optimizer contract.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from ..distributed import Reducer, resolve_reducer
from .blocking import BlockSpec, block_slices, merge_dims
from .config import (
    COMMUNICATION_DTYPES,
    EigenConfig,
    GraftingConfig,
    RootInvConfig,
    config_from_dict,
    config_to_dict,
    resolved_start,
    validate_group,
)
from .distributor import assign_blocks, block_cost, gather_directions
from .grafting import (
    grafting_direction,
    grafting_has_state,
    update_grafting,
    update_grafting_out_of_place,
)
from .preconditioner import (
    EigenvalueCorrectedPreconditioner,
    Preconditioner,
    RootInversePreconditioner,
)
from .root_inverse import finite_per_matrix

__all__ = ["Shampoo"]

_STRUCTURAL = ("max_preconditioner_dim", "preconditioner", "factor_dtype")


@dataclass
class _Block:
    param: Tensor
    group_index: int
    param_index: int
    merged: tuple[int, ...]
    spec: BlockSpec
    gid: int
    owner: int
    name: str

    def view(self, t: Tensor) -> Tensor:
        return t.view(self.merged)[self.spec.slices()]


@dataclass
class _Batch:
    """The owned blocks of one shape (one parameter group, dtype and device), stacked."""

    group_index: int
    shape: tuple[int, ...]
    blocks: list[_Block]
    state: dict[str, Tensor] = field(default_factory=dict)
    factored: tuple[bool, ...] = ()


@dataclass
class _Prepared:
    """One batch's blocks with a gradient: their state (a copy if not all), G and W."""

    blocks: list[_Block]
    index: Tensor | None
    state: dict[str, Tensor]
    G: Tensor
    W: Tensor | None


def _structure(group: dict[str, Any]) -> tuple[Any, ...]:
    """What fixes the layout of the state: changing it after the first step is an error."""
    return (
        *(group[k] for k in _STRUCTURAL),
        group["betas"][0] != 0.0,
        group["momentum"] != 0.0,
        grafting_has_state(group["grafting_config"]),
    )


class Shampoo(torch.optim.Optimizer):
    r"""Distributed Shampoo: block-diagonal Kronecker-factored AdaGrad-family optimizer.

    Each parameter is reshaped and cut into blocks (:mod:`~secondorder.shampoo.blocking`);
    each block ``G`` of order ``r`` keeps one factor per dimension,
    ``F_k ← β₂F_k + (1−β₂)G₍ₖ₎G₍ₖ₎ᵀ``, and, every ``precondition_frequency`` steps from
    ``start_preconditioning_step`` on, their inverse roots ``(F̂_k + εI)^(−1/2r)``.  The
    step is ``W ← W − lr·P`` with ``P = M ×₁ F̂₁^(−1/2r) … ×_r F̂_r^(−1/2r)`` for the
    filtered gradient ``M ← β₁M + (1−β₁)G`` (bias-corrected), rescaled per block to the
    norm of the grafted method's direction; before preconditioning starts, the grafted
    direction itself.  Then decoupled weight decay and optional (Nesterov) momentum.
    ``preconditioner="eigenvalue_corrected"`` keeps Adam's second moment in the factors'
    eigenbasis instead (SOAP).  A root applied to fewer vectors between refreshes than
    its size (``precondition_frequency · m < d``) is stored as ``D`` with root ``DᵀD``
    (state key ``block{i}.root_factor{k}`` instead of ``block{i}.root{k}``), which
    skips the ``2d³`` product that would form it; the step is the same to rounding.

    Non-finite gradients, and finite ones that would overflow the factors or the
    grafting state (checked exactly in float64, see ``_check_overflow``), raise
    ``FloatingPointError`` before any state or parameter changes.

    Step count, as in DistributedShampoo: ``t`` (bias corrections, root schedule) is
    one count per parameter group, advanced by every ``step()`` in which any of the
    group's parameters has a gradient.  A parameter whose gradient is ``None`` is
    skipped (value and state unchanged), and when it next steps it uses the group's
    ``t``, whereas ``torch.optim.Adam`` counts each parameter's own steps: equality
    with ``torch.optim`` (before preconditioning) holds when every parameter of a group
    gets a gradient at every step, so give parameters that skip steps their own group.
    The count stays per group because the blocks of a batch share one ``t``: one bias
    correction and one root schedule per batched call.

    Choose it over Adam/AdamW when the extra per-step cost (an eigendecomposition per
    factor every ``precondition_frequency`` steps) buys fewer steps; start from the
    tuned AdamW settings with ``grafting_config=AdamGraftingConfig(...)``,
    ``betas=(0.9, 0.999)`` and ``precondition_frequency`` of 10 to 100.

    Args:
        params: parameters or parameter groups (every argument below except
            ``reducer``, ``process_group`` and ``communication_dtype`` may be set per group).
        lr: learning rate.
        betas: ``(β₁, β₂)``: β₁ filters the gradient (0 disables), β₂ the factors
            (1: plain sums, AdaGrad-like).
        epsilon: added to the factors' diagonal before the root (must be 0 with
            ``EigenConfig(pseudo_inverse=True)``); for the eigenvalue-corrected
            variant, added to ``sqrt(E)`` as in Adam.
        momentum, dampening, use_nesterov: momentum ``μ`` on the final direction,
            ``b ← μb + (1−d)P``, then ``P ← b`` (Nesterov: ``P ← (1−d)P + μb``), with
            ``b`` starting at zero as in DistributedShampoo.  With ``dampening=0`` (the
            default) this is ``torch.optim.SGD``'s rule; with ``d > 0`` it is not:
            SGD starts ``b`` at the first direction, ``b₁ = P₁``, here ``b₁ = (1−d)P₁``,
            so every later ``b_t`` is SGD's minus ``d·μ^(t−1)·P₁``.
        weight_decay: decoupled (added to the direction, AdamW-style) if
            ``use_decoupled_weight_decay`` else L2 (added to the gradient).
        max_preconditioner_dim: largest factor dimension (blocks are cut to it).
        precondition_frequency: steps between root (or eigenbasis) computations.
        start_preconditioning_step: first preconditioned step; ``None`` (or ``-1``)
            means ``precondition_frequency``, read at every step (the group keeps
            ``None``), so a later change of ``precondition_frequency`` moves it along.
        use_bias_correction: divide by ``1−β₁ᵗ`` and ``1−β₂ᵗ``.
        grafting_config: ``None`` or an SGD/AdaGrad/RMSprop/Adam grafting config.
        preconditioner: ``"root_inverse"`` (Shampoo) or ``"eigenvalue_corrected"`` (SOAP).
        root_inv_config: ``EigenConfig(...)`` (default) or ``CoupledNewtonConfig(...)``.
        factor_dtype: dtype of factors and roots; ``None`` is the parameter's dtype.
        num_tolerated_failed_amortized_computations: consecutive failed root
            computations of one block that keep the previous root (with a warning)
            before an error.
        reducer, process_group: the data-parallel group (see
            :func:`secondorder.distributed.resolve_reducer`); blocks are divided among
            its ranks and the directions all-gathered.  The gradients must already be
            averaged across ranks (DDP does this).
        communication_dtype: dtype of the all-gathered directions; ``None`` is the
            parameter's dtype (bitwise equal to one process); ``torch.bfloat16`` halves
            the bytes.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        dampening: float = 0.0,
        use_nesterov: bool = False,
        weight_decay: float = 0.0,
        use_decoupled_weight_decay: bool = True,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        use_bias_correction: bool = True,
        grafting_config: GraftingConfig | None = None,
        preconditioner: str = "root_inverse",
        root_inv_config: RootInvConfig | None = None,
        factor_dtype: torch.dtype | None = None,
        num_tolerated_failed_amortized_computations: int = 3,
        *,
        reducer: Reducer | None = None,
        process_group: Any = None,
        communication_dtype: torch.dtype | None = None,
    ) -> None:
        if communication_dtype not in COMMUNICATION_DTYPES:
            raise ValueError(
                f"Invalid communication_dtype={communication_dtype!r}: must be None (the "
                "parameter's dtype), torch.float32, torch.float64, torch.bfloat16 or "
                "torch.float16."
            )
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            "epsilon": epsilon,
            "momentum": momentum,
            "dampening": dampening,
            "use_nesterov": use_nesterov,
            "weight_decay": weight_decay,
            "use_decoupled_weight_decay": use_decoupled_weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "use_bias_correction": use_bias_correction,
            "grafting_config": grafting_config,
            "preconditioner": preconditioner,
            "root_inv_config": EigenConfig() if root_inv_config is None else root_inv_config,
            "factor_dtype": factor_dtype,
            "num_tolerated_failed_amortized_computations": (
                num_tolerated_failed_amortized_computations
            ),
        }
        self._built = False
        self._batches: list[_Batch] = []
        self._blocks: list[_Block] = []
        self._structures: list[tuple[Any, ...]] = []
        super().__init__(params, defaults)
        self.reducer = resolve_reducer(reducer, process_group)
        self.communication_dtype = communication_dtype

    # -- configuration -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        # Checked on a copy with the defaults filled in, before torch appends the group:
        # a refused group leaves param_groups (and every later step) as they were.
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch names the set error itself
            params = list(params)  # a generator is read once, here
            param_group["params"] = params
        probe = {**self.defaults, **param_group}
        self._normalize(probe)
        validate_group(probe)
        for q in params:
            q = q[1] if isinstance(q, tuple) else q  # (name, parameter) pairs
            if isinstance(q, Tensor) and not q.is_floating_point():
                raise TypeError(
                    f"Shampoo optimizes floating-point parameters; got one of dtype {q.dtype} "
                    f"and shape {tuple(q.shape)}"
                )
        super().add_param_group(param_group)
        self._normalize(self.param_groups[-1])
        self._built = False

    @staticmethod
    def _normalize(group: dict[str, Any]) -> None:
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        group["grafting_config"] = config_from_dict(group["grafting_config"])
        group["root_inv_config"] = config_from_dict(group["root_inv_config"])

    def _block_name(self, group_index: int, param_index: int, p: Tensor) -> str:
        names = self.param_groups[group_index].get("param_names")
        if names is not None:
            return f"parameter {names[param_index]!r} (shape {tuple(p.shape)})"
        return (
            f"parameter param_groups[{group_index}]['params'][{param_index}] "
            f"(shape {tuple(p.shape)})"
        )

    def _preconditioner(
        self, group: dict[str, Any], shape: tuple[int, ...], factored: tuple[bool, ...] = ()
    ) -> Preconditioner:
        cls = (
            RootInversePreconditioner
            if group["preconditioner"] == "root_inverse"
            else EigenvalueCorrectedPreconditioner
        )
        return cls(
            shape=shape,
            beta2=float(group["betas"][1]),
            epsilon=float(group["epsilon"]),
            use_bias_correction=group["use_bias_correction"],
            root_inv_config=group["root_inv_config"],
            factored=factored,
        )

    def _factored(self, group: dict[str, Any], batch: _Batch) -> tuple[bool, ...]:
        """Which factors keep their root as ``D`` (root ``DᵀD``): see ``preconditioner``.

        Factored when ``precondition_frequency · m < d`` (``m`` = block size / ``d``) and
        the roots come from eigh.  A saved state's layout wins, so a state dict loads
        whatever the frequency is now; the layout never changes the math.
        """
        shape = batch.shape
        if group["preconditioner"] != "root_inverse":
            return tuple(False for _ in shape)
        saved = self.state.get(batch.blocks[0].param, {})
        index = batch.blocks[0].spec.index
        out = []
        for k, d in enumerate(shape):
            if f"block{index}.root_factor{k}" in saved:
                out.append(True)
            elif f"block{index}.root{k}" in saved:
                out.append(False)
            else:
                m = math.prod(shape) // d
                out.append(
                    isinstance(group["root_inv_config"], EigenConfig)
                    and group["precondition_frequency"] * m < d
                )
        return tuple(out)

    # -- building the blocks and the stacked state ----------------------------------------
    def _build(self) -> None:
        """Cut parameters into blocks, assign owners, stack the owned blocks' state.

        Per-parameter state (torch's schema) holds views into the stacked buffers, so
        ``state_dict`` sees every block while each stage runs as one batched call.
        """
        world = self.reducer.world_size
        blocks: list[_Block] = []
        for gi, group in enumerate(self.param_groups):
            mpd = group["max_preconditioner_dim"]
            for pi, p in enumerate(group["params"]):
                if p.numel() == 0:
                    continue
                merged = merge_dims(p.shape, mpd)
                name = self._block_name(gi, pi, p)
                for spec in block_slices(merged, mpd):
                    blocks.append(_Block(p, gi, pi, merged, spec, len(blocks), 0, name))
        owners = assign_blocks([block_cost(b.spec.shape) for b in blocks], world)
        for b, r in zip(blocks, owners, strict=True):
            b.owner = r
        self.reducer.check_agree(
            {
                "blocks": [(b.group_index, b.param_index, b.spec.shape) for b in blocks],
                "param_groups": [
                    {k: repr(v) for k, v in g.items() if k not in ("params", "lr")}
                    for g in self.param_groups
                ],
                "communication_dtype": repr(self.communication_dtype),
            },
            "Shampoo configuration",
        )
        by_key: dict[tuple[Any, ...], _Batch] = {}
        for b in blocks:
            if b.owner != self.reducer.rank:
                continue
            key = (b.group_index, b.spec.shape, b.param.dtype, b.param.device)
            if key not in by_key:
                by_key[key] = _Batch(b.group_index, b.spec.shape, [])
            by_key[key].blocks.append(b)
        for batch in by_key.values():
            group = self.param_groups[batch.group_index]
            p0 = batch.blocks[0].param
            fdtype = group["factor_dtype"] or p0.dtype
            B = len(batch.blocks)
            batch.factored = self._factored(group, batch)
            pre = self._preconditioner(group, batch.shape, batch.factored)
            state = pre.init_state(B, fdtype, p0.device)
            elementwise = (
                ("filtered_grad", group["betas"][0] != 0.0),
                ("grafting_state", grafting_has_state(group["grafting_config"])),
                ("momentum_buffer", group["momentum"] != 0.0),
            )
            for name, wanted in elementwise:
                if wanted:
                    state[name] = torch.zeros(B, *batch.shape, dtype=p0.dtype, device=p0.device)
            batch.state = state
            for i, b in enumerate(batch.blocks):
                pstate = self.state[b.param]
                for state_key, buf in state.items():
                    entry = f"block{b.spec.index}.{state_key}"
                    if entry in pstate:
                        saved = pstate[entry]
                        if saved.shape != buf[i].shape:
                            raise ValueError(
                                f"the saved state {entry!r} of {b.name} has shape "
                                f"{tuple(saved.shape)}, expected {tuple(buf[i].shape)}: it was "
                                "saved with other max_preconditioner_dim or parameters"
                            )
                        buf[i].copy_(saved)
                    pstate[entry] = buf[i]
        for group in self.param_groups:
            for p in group["params"]:
                # An int64 count: a float32 one stops at 2²⁴ (2²⁴ + 1 rounds back), and the
                # roots would then never refresh again.  Older state dicts saved a float
                # counter, exact below 2²⁴: converted here.
                step = self.state[p].get("step")
                if step is None or step.dtype != torch.int64:
                    count = 0 if step is None else int(step.item())
                    self.state[p]["step"] = torch.tensor(count, dtype=torch.int64)
        self._blocks = blocks
        self._batches = list(by_key.values())
        self._structures = [_structure(g) for g in self.param_groups]
        self._built = True

    # -- the step ---------------------------------------------------------------------
    def _check_gradients(self) -> None:
        grads = [
            (gi, pi, p)
            for gi, g in enumerate(self.param_groups)
            for pi, p in enumerate(g["params"])
            if p.grad is not None
        ]
        if not grads:
            return
        for _, _, p in grads:
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError("Shampoo does not support sparse gradients; densify them first")
        # amax/amin propagate NaN and expose ±Inf: two fast reductions per gradient
        # instead of isfinite's elementwise passes (see finite_per_matrix).
        finite = torch.stack(
            [
                finite_per_matrix(p.grad.reshape(1, -1)).squeeze(0)
                if p.grad.numel()
                else torch.tensor(True, device=p.grad.device)
                for _, _, p in grads
                if p.grad is not None
            ]
        )
        if bool(finite.all()):
            return
        bad = [
            self._block_name(gi, pi, p)
            for (gi, pi, p), ok in zip(grads, finite.tolist(), strict=True)
            if not ok
        ]
        raise FloatingPointError(
            f"non-finite gradient (NaN or Inf) in {', '.join(bad)}; no state was changed. "
            "Skip this batch, lower the learning rate, or use gradient clipping or loss scaling."
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one Shampoo step; ``closure`` (optional) re-evaluates and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._normalize(group)
            validate_group(group)
        if not self._built:
            self._build()
        for gi, group in enumerate(self.param_groups):
            if _structure(group) != self._structures[gi]:
                raise ValueError(
                    f"param_groups[{gi}] changed one of {_STRUCTURAL} (or switched β₁, "
                    "momentum or the grafting state on or off) after the optimizer state was "
                    "built; these fix the shape of the state. Build a new Shampoo instead."
                )
        self._check_gradients()
        steps: dict[int, int] = {}
        for gi, group in enumerate(self.param_groups):
            if any(p.grad is not None for p in group["params"]):
                steps[gi] = int(self.state[group["params"][0]]["step"].item()) + 1
        prepared = [
            (batch, prep)
            for batch in self._batches
            if batch.group_index in steps and (prep := self._prepare(batch)) is not None
        ]
        self._check_overflow(prepared)
        directions: dict[int, Tensor] = {}
        for batch, prep in prepared:
            self._step_batch(batch, prep, steps[batch.group_index], directions)
        self._apply(directions)
        for gi, t in steps.items():
            for p in self.param_groups[gi]["params"]:
                self.state[p]["step"].fill_(t)
        return loss

    def _prepare(self, batch: _Batch) -> _Prepared | None:
        """The stacked gradients (L2 decay added) and state of the blocks with a gradient."""
        group = self.param_groups[batch.group_index]
        active = [i for i, b in enumerate(batch.blocks) if b.param.grad is not None]
        if not active:
            return None
        index = None
        if len(active) == len(batch.blocks):
            S = batch.state
        else:
            index = torch.tensor(active, device=batch.blocks[0].param.device)
            S = {k: v.index_select(0, index) for k, v in batch.state.items()}
        blocks = [batch.blocks[i] for i in active]
        G = torch.stack([b.view(cast(Tensor, b.param.grad)) for b in blocks])
        wd = float(group["weight_decay"])
        W = torch.stack([b.view(b.param) for b in blocks]) if wd != 0.0 else None
        if W is not None and not group["use_decoupled_weight_decay"]:
            G.add_(W, alpha=wd)
        return _Prepared(blocks, index, S, G, W)

    def _check_overflow(self, prepared: list[tuple[_Batch, _Prepared]]) -> None:
        """Refuse, before any state changes, a finite gradient that would overflow the state.

        Every factor is positive semi-definite, so its largest entry is on the diagonal,
        ``β₂F_ii + α‖G₍ₖ₎ row i‖²``: computed in float64 from the diagonal and the
        gradient, it tells exactly whether ``F`` would overflow without forming it (and
        ``GGᵀ`` before the ``α`` scaling must fit as well).  The
        grafting state is checked entrywise the same way (``g²`` included) and the
        eigenvalue-corrected second moment by ``β₂ max E + α‖G‖²`` (no rotation makes an
        entry larger).  A
        state entry may reach half the dtype's largest value, leaving room for rounding.
        """
        bad_names: list[str] = []
        for batch, prep in prepared:
            group = self.param_groups[batch.group_index]
            S, G = prep.state, prep.G
            beta2 = float(group["betas"][1])
            alpha = 1.0 if beta2 == 1.0 else 1.0 - beta2
            sq = G.to(torch.float64).square()
            B = sq.shape[0]
            fmax = torch.finfo(S["factor0"].dtype).max / 2
            peaks = []
            for k, d in enumerate(batch.shape):
                rows = sq.movedim(k + 1, 1).reshape(B, d, -1).sum(-1)
                diag = S[f"factor{k}"].diagonal(dim1=-2, dim2=-1).to(torch.float64)
                # baddbmm forms GGᵀ before scaling it by α: that product must fit too.
                peaks.append(torch.maximum(beta2 * diag + alpha * rows, rows).amax(-1) / fmax)
            if "corrected_eigenvalues" in S:
                E = S["corrected_eigenvalues"].reshape(B, -1).amax(-1).to(torch.float64)
                norm2 = sq.reshape(B, -1).sum(-1)
                peaks.append(torch.maximum(beta2 * E + alpha * norm2, norm2) / fmax)
            v = S.get("grafting_state")
            if v is not None:
                new_v = update_grafting_out_of_place(
                    group["grafting_config"], v.to(torch.float64), sq
                )
                vmax = torch.finfo(v.dtype).max / 2
                peaks.append(torch.maximum(new_v, sq).reshape(B, -1).amax(-1) / vmax)
            # NaN (from inf − inf) compares False: "not <= 1" catches it too.
            over = ~(torch.stack(peaks).amax(0) <= 1.0)
            if bool(over.any()):
                bad_names.extend(
                    sorted({prep.blocks[i].name for i in over.nonzero().flatten().tolist()})
                )
        if bad_names:
            raise FloatingPointError(
                f"the gradient of {', '.join(bad_names)} is finite but would overflow "
                "Shampoo's factors or grafting state (an entry above half the largest finite "
                "value of their dtype); no state was changed. Skip this batch, lower the "
                "learning rate, clip or rescale the gradients, or use "
                "factor_dtype=torch.float64."
            )

    def _step_batch(
        self, batch: _Batch, prep: _Prepared, t: int, directions: dict[int, Tensor]
    ) -> None:
        group = self.param_groups[batch.group_index]
        blocks, index, S, G, W = prep.blocks, prep.index, prep.state, prep.G, prep.W
        wd = float(group["weight_decay"])
        decoupled = group["use_decoupled_weight_decay"]
        beta1 = float(group["betas"][0])
        grafting = group["grafting_config"]
        pre = self._preconditioner(group, batch.shape, batch.factored)
        fdtype = S["factor0"].dtype
        Gf = G.to(fdtype)
        pre.update_factors(S, Gf)
        update_grafting(grafting, S.get("grafting_state"), G)
        start, freq = resolved_start(group), group["precondition_frequency"]
        if (t % freq == 0 and t > start) or t == start:
            self._amortize(pre, S, t, blocks, group)
        pre.after_amortize(S, Gf, t)
        if beta1 != 0.0:
            S["filtered_grad"].lerp_(G, 1.0 - beta1)
            M = S["filtered_grad"]
            if group["use_bias_correction"]:
                M = M / (1.0 - beta1**t)
        else:
            M = G
        if t < start and grafting is not None:
            P = grafting_direction(grafting, S.get("grafting_state"), M, t)
        else:
            P = pre.precondition(S, M.to(fdtype), t).to(G.dtype)
            if grafting is not None:
                dims = tuple(range(1, P.ndim))
                graft = grafting_direction(grafting, S.get("grafting_state"), M, t)
                scale = torch.linalg.vector_norm(graft, dim=dims) / (
                    torch.linalg.vector_norm(P, dim=dims) + 1e-16
                )
                P = P * scale.view(-1, *([1] * len(dims)))
        if P is M or P is G or P is S.get("filtered_grad"):
            P = P.clone()
        if W is not None and decoupled:
            P.add_(W, alpha=wd)
        if "momentum_buffer" in S:
            mom, damp = float(group["momentum"]), float(group["dampening"])
            buf = S["momentum_buffer"]
            buf.mul_(mom).add_(P, alpha=1.0 - damp)
            if group["use_nesterov"]:
                P.mul_(1.0 - damp).add_(buf, alpha=mom)
            else:
                P = buf.clone()
        if index is not None:
            for k, v in S.items():
                batch.state[k].index_copy_(0, index, v)
        for i, b in enumerate(blocks):
            directions[b.gid] = P[i]

    def _amortize(
        self,
        pre: Preconditioner,
        S: dict[str, Tensor],
        t: int,
        blocks: list[_Block],
        group: dict[str, Any],
    ) -> None:
        failed = pre.amortize(S, t)
        counter = S["failed_amortized_computations"]
        failed_blocks = sorted({i for i, _ in failed})
        mask = torch.zeros_like(counter, dtype=torch.bool)
        mask[failed_blocks] = True
        counter.add_(mask.to(counter.dtype)).mul_(mask.to(counter.dtype))
        tolerated = group["num_tolerated_failed_amortized_computations"]
        for i in failed_blocks:
            b = blocks[i]
            factors = [k for j, k in failed if j == i]
            count = int(counter[i])
            if count > tolerated:
                raise RuntimeError(
                    f"the root computation of block {b.spec.index} (factors {factors}) of "
                    f"{b.name} failed {count} times in a row, more than "
                    f"num_tolerated_failed_amortized_computations={tolerated}. Check the "
                    "gradients, raise epsilon, or use factor_dtype=torch.float64."
                )
            warnings.warn(
                f"Shampoo: the root computation of block {b.spec.index} (factors {factors}) "
                f"of {b.name} failed at step {t} even in float64; keeping its previous "
                f"root ({count} failure(s) in a row, {tolerated} tolerated).",
                RuntimeWarning,
                stacklevel=4,
            )

    def _apply(self, directions: dict[int, Tensor]) -> None:
        """``W ← W − lr·P`` for every block with a gradient, after gathering if distributed."""
        active = [b for b in self._blocks if b.param.grad is not None]
        if self.reducer.world_size > 1 and active:
            world = self.reducer.world_size
            counts = [0] * world
            for b in active:
                counts[b.owner] += math.prod(b.spec.shape)
            mine = [directions[b.gid] for b in active if b.owner == self.reducer.rank]
            ref = active[0].param
            dtype = self.communication_dtype or ref.dtype
            flats = gather_directions(self.reducer, mine, counts, dtype, ref.device)
            offsets = [0] * world
            for b in active:
                n = math.prod(b.spec.shape)
                chunk = flats[b.owner][offsets[b.owner] : offsets[b.owner] + n]
                offsets[b.owner] += n
                directions[b.gid] = chunk.view(b.spec.shape).to(b.param.dtype)
        for b in active:
            lr = float(self.param_groups[b.group_index]["lr"])
            b.view(b.param).add_(directions[b.gid], alpha=-lr)

    # -- state dict ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Torch's schema; configs become plain dicts so ``weights_only=True`` loads it.

        In a distributed run each rank's state holds the blocks it owns: save one file
        per rank and load it into the same rank of a run with the same world size.
        """
        if not self._built:
            self._build()
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g["grafting_config"] = config_to_dict(g["grafting_config"])
            g["root_inv_config"] = config_to_dict(g["root_inv_config"])
        sd["shampoo"] = {
            "rank": self.reducer.rank,
            "world_size": self.reducer.world_size,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, bit for bit (no dtype casts of the factors)."""
        meta = state_dict.get("shampoo", {"rank": 0, "world_size": 1})
        here = {"rank": self.reducer.rank, "world_size": self.reducer.world_size}
        if meta != here:
            raise ValueError(
                f"this state dict was saved by rank {meta['rank']} of {meta['world_size']}, "
                f"but this optimizer is rank {here['rank']} of {here['world_size']}: load "
                "each rank's own file into a run with the same world size."
            )
        # All or nothing: the groups are checked before anything changes; a saved state
        # that does not fit the blocks is found only by building them, so the previous
        # groups, state and blocks are put back if that fails.
        saved_groups = state_dict["param_groups"]
        groups = [dict(g) for g in saved_groups]
        for g in groups:
            g["grafting_config"] = config_from_dict(g.get("grafting_config"))
            g["root_inv_config"] = config_from_dict(g.get("root_inv_config"))
            self._normalize(g)
            validate_group(g)
        previous = (
            self.param_groups,
            self.state,
            self._built,
            self._batches,
            self._blocks,
            self._structures,
        )
        try:
            # Torch's loader would cast floating state to the parameter's dtype (a float64
            # factor of a float32 parameter would lose bits), so the state is restored here.
            super().load_state_dict({"state": {}, "param_groups": groups})
            id_to_param = {
                pid: p
                for sg, g in zip(saved_groups, self.param_groups, strict=True)
                for pid, p in zip(sg["params"], g["params"], strict=True)
            }
            self.state = defaultdict(dict)
            for pid, pstate in state_dict["state"].items():
                p = id_to_param[pid]
                self.state[p] = {k: v.detach().clone().to(p.device) for k, v in pstate.items()}
            for group in self.param_groups:
                self._normalize(group)
            self._built = False
            self._build()
        except BaseException:
            (
                self.param_groups,
                self.state,
                self._built,
                self._batches,
                self._blocks,
                self._structures,
            ) = previous
            raise
