"""K-FAC as a gradient preconditioner that any ``torch.optim`` optimizer follows.

The loop is KAISA's: forward, backward, ``kfac.step()`` (which rewrites ``.grad`` of
every preconditioned layer), then ``optimizer.step()``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import Reducer, resolve_reducer
from .assignment import WorkAssignment, assign_work, factor_cost
from .config import KFACConfig, check_damping
from .layers import ConvLayer, EmbeddingLayer, KFACLayer, LinearLayer

__all__ = ["KFAC", "SUPPORTED_MODULES"]

#: Module classes K-FAC preconditions; everything else keeps its plain gradient.
SUPPORTED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
# Containers that use their submodules' weights without calling the submodules, so
# those submodules' hooks never fire.
_FUNCTIONAL_PARENTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _make_layer(name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> KFACLayer:
    if isinstance(module, nn.Linear):
        return LinearLayer(name, module, factor_dtype)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return ConvLayer(name, module, factor_dtype)
    if isinstance(module, nn.Embedding):
        return EmbeddingLayer(name, module, factor_dtype)
    raise TypeError(
        f"layer {name!r} is a {type(module).__name__}, which K-FAC does not support; "
        f"supported kinds are {[c.__name__ for c in SUPPORTED_MODULES]}"
    )


def _pack(t: Tensor) -> Tensor:
    n = t.shape[-1]
    iu = torch.triu_indices(n, n, device=t.device)
    return t[..., iu[0], iu[1]]


def _unpack(v: Tensor, n: int) -> Tensor:
    iu = torch.triu_indices(n, n, device=v.device)
    out = v.new_zeros((*v.shape[:-1], n, n))
    out[..., iu[0], iu[1]] = v
    return out + torch.triu(out, diagonal=1).mT


def _in_functorch_transform() -> bool:
    # torch.func exposes no public "am I inside a transform" test; the interpreter
    # stack is empty outside every vmap/grad/jacrev
    return torch._C._functorch.peek_interpreter_stack() is not None


def _all_finite(t: Tensor) -> bool:
    # A sum is finite only if every term is (inf and NaN propagate): one reduction
    # instead of isfinite's full-size temporaries; the elementwise test settles a
    # finite tensor whose sum overflowed.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


class KFAC:
    r"""Kronecker-factored preconditioning of Linear, Conv1d/2d and Embedding gradients.

    For each layer with weight gradient ``∇`` (outputs × inputs, bias as a last
    column), K-FAC replaces ``∇`` by the solution ``P`` of ``(A ⊗ G + λI) vec P =
    vec ∇`` (``compute_method="eigen"``, exact through the factors' eigenvectors:
    ``P = Q_G[(Q_Gᵀ∇Q_A) / (d_G d_Aᵀ + λ)]Q_Aᵀ``) or by ``(G + λI)⁻¹∇(A + λI)⁻¹``
    (``"inverse"``, cheaper, damps each factor), then scales all of them by the KL clip
    ``ν = min(1, √(kl_clip / |lr² Σ⟨P, ∇⟩|))``.  ``A`` and ``G`` are running averages
    (``factor_decay``) starting at the identity.

    Scaling convention (differs from KAISA's on purpose): ``A = mean a aᵀ`` and
    ``G = mean over samples of Σ_positions g gᵀ`` where ``g`` is the gradient of each
    sample's *own* loss, i.e. ``N · ∂L/∂s`` for the mean loss ``L`` of a micro-batch of
    ``N`` (``loss_reduction="mean"``; with accumulation the loss is also divided by
    ``accumulation_steps``).  ``A ⊗ G`` is then the empirical Fisher of one sample: it
    does not change with the batch size or the number of ranks, and ``kl_clip`` bounds
    the per-sample KL divergence.  KAISA builds a Linear layer's G from mean-loss
    gradients, so its G is ours divided by ``B²`` (``B`` its per-rank batch) and its
    eigen-method step is ``B²`` times ours at damping ``B²·λ``, and our clip factor ν is
    ``B²`` times its.  So ``damping=B²·λ, kl_clip=B²·c`` at the same lr reproduces a
    KAISA run (damping λ, kl_clip c) exactly whenever our clip is active (KAISA's
    ν < 1/B²); without clipping, use ``lr·B²`` instead.  Dimension 0 of a layer's input
    is the batch.  A layer called several times in one call of the model (weight sharing)
    counts its calls as more positions of the same samples, as one call over stacked
    inputs would; every training-mode forward must be backpropagated before
    :meth:`step` (wrap metrics in ``torch.no_grad()``), and calls inside ``torch.func``
    transforms are not captured.

    Distribution (``torch.distributed`` through a :class:`~secondorder.distributed.Reducer`):
    every rank must hold the gradient of the global batch (DDP, or an all-reduce of its
    own) before :meth:`step`.  The factor statistics are summed over ranks, so W ranks
    equal one process on the concatenated batch; each layer's decomposition is done by
    one rank (:func:`~secondorder.kfac.assignment.assign_work`) and shared according to
    ``grad_worker_fraction`` (COMM-OPT 1, MEM-OPT 1/W, HYBRID-OPT between).

    Args:
        model: the model (or a DDP wrapper); its supported submodules get hooks.
        modules: names of the submodules to precondition (default: every supported,
            trainable one not in ``skip_layers``).
        grad_scaler: a ``torch.amp.GradScaler`` (or a callable returning the current
            scale) whose scaled loss is backpropagated; G is built from unscaled
            gradients, and a factor update with non-finite statistics is skipped.
        reducer, process_group: see :func:`secondorder.distributed.resolve_reducer`.
        Other arguments: see :class:`~secondorder.kfac.config.KFACConfig`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] = 1,
        inv_update_steps: int | Callable[[int], int] = 1,
        damping: float | Callable[[int], float] = 1e-3,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | Callable[[int], float | None] | None = 1e-3,
        lr: float | Callable[[int], float] = 0.1,
        accumulation_steps: int = 1,
        compute_method: str = "eigen",
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Sequence[str] = (),
        modules: Sequence[str] | None = None,
        grad_worker_fraction: float | str = 1.0,
        assignment_strategy: str = "compute",
        symmetry_aware: bool = False,
        loss_reduction: str = "mean",
        grad_scaler: Any = None,
        reducer: Reducer | None = None,
        process_group: Any = None,
    ) -> None:
        if isinstance(skip_layers, str):
            skip_layers = (skip_layers,)
        self.config = KFACConfig(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            compute_method=compute_method,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=tuple(skip_layers),
            grad_worker_fraction=grad_worker_fraction,
            assignment_strategy=assignment_strategy,
            symmetry_aware=symmetry_aware,
            loss_reduction=loss_reduction,
        )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if grad_scaler is not None and not (
            hasattr(grad_scaler, "get_scale") or callable(grad_scaler)
        ):
            raise TypeError(
                f"Invalid grad_scaler={grad_scaler!r}: must be a torch.amp.GradScaler or a "
                "callable returning the current loss scale."
            )
        self.grad_scaler = grad_scaler
        layers, skipped = self._discover(model, modules)
        self.reducer = resolve_reducer(reducer, process_group)
        world = self.reducer.world_size
        k = self.config.grad_workers(world)
        costs = {
            name: factor_cost(
                [s[-1] for s in layer.factor_shapes()], self.config.assignment_strategy
            )
            for name, layer in layers.items()
        }
        self.assignment: WorkAssignment = assign_work(costs, world, k)
        self.reducer.check_agree(
            {"layers": list(layers), "grad_workers": k, "compute_method": compute_method},
            "K-FAC layers and settings",
        )
        # building sub-groups is collective: every rank does it, in the same order
        self._workers = self.reducer.split(self.assignment.worker_groups())
        self._receivers = self.reducer.split(self.assignment.receiver_groups())
        #: name → layer, for every preconditioned module, in model order.
        self.layers: dict[str, KFACLayer] = layers
        #: name → why the module keeps its plain gradient.
        self.skipped: dict[str, str] = skipped
        self.steps = 0
        #: λ set by adaptive damping; None follows ``config.damping``.
        self.damping_override: float | None = None
        #: factor updates dropped because their statistics were not finite.
        self.skipped_factor_updates = 0
        self._warned: set[str] = set()
        self._capturing = True
        #: calls of the model so far, and the call in which each layer last ran.
        self._pass = 0
        self._layer_pass: dict[str, int] = {}
        self._handles = [model.register_forward_pre_hook(self._new_pass)]
        self._handles += [
            layer.module.register_forward_hook(self._forward_hook(layer))
            for layer in layers.values()
        ]

    # -- discovery ---------------------------------------------------------------------
    def _discover(
        self, model: nn.Module, modules: Sequence[str] | None
    ) -> tuple[dict[str, KFACLayer], dict[str, str]]:
        named = dict(model.named_modules())
        skip = {s.lower() for s in self.config.skip_layers}
        functional: set[str] = set()
        for name, m in named.items():
            if isinstance(m, _FUNCTIONAL_PARENTS):
                functional.update(f"{name}.{c}" if name else c for c, _ in m.named_modules() if c)
        if modules is not None:
            if isinstance(modules, str):
                modules = [modules]
            unknown = [m for m in modules if m not in named]
            if unknown:
                raise ValueError(
                    f"Invalid modules={list(modules)!r}: {unknown} are not submodule names of "
                    "the model (see model.named_modules())."
                )
            for m in modules:
                if not isinstance(named[m], SUPPORTED_MODULES):
                    raise TypeError(
                        f"Invalid modules entry {m!r}: it is a {type(named[m]).__name__}, which "
                        f"K-FAC does not support; supported kinds are "
                        f"{[c.__name__ for c in SUPPORTED_MODULES]}. Leave it out and it keeps "
                        "its plain gradient."
                    )
                if m in functional:
                    raise ValueError(
                        f"Invalid modules entry {m!r}: its parent calls its weight functionally, "
                        "so its hooks never fire."
                    )
        layers: dict[str, KFACLayer] = {}
        skipped: dict[str, str] = {}
        for name, m in named.items():
            label = name or "<model>"
            own = [p for p in m.parameters(recurse=False)]
            if modules is not None and name not in modules:
                if own:
                    skipped[label] = "not in modules"
                continue
            if not isinstance(m, SUPPORTED_MODULES):
                if own:
                    skipped[label] = f"{type(m).__name__} is not supported"
                continue
            if name.lower() in skip or type(m).__name__.lower() in skip:
                skipped[label] = "in skip_layers"
            elif name in functional:
                skipped[label] = "weight used functionally by its parent"
            elif not m.weight.requires_grad:
                skipped[label] = "frozen (weight.requires_grad is False)"
            else:
                layers[label] = _make_layer(label, m, self.config.factor_dtype)
        if not layers:
            raise ValueError(
                "the model has no layer K-FAC can precondition (supported: "
                f"{[c.__name__ for c in SUPPORTED_MODULES]}, trainable, not in skip_layers); "
                f"skipped: {skipped or 'no module with parameters'}"
            )
        return layers, skipped

    # -- hooks -------------------------------------------------------------------------
    def _grad_scale(self) -> float:
        s = self.grad_scaler
        if s is None:
            return 1.0
        value = s.get_scale() if hasattr(s, "get_scale") else s()
        return float(value)

    def _new_pass(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        # One call of the model is one pass over its batch: a layer called several
        # times in it (weight sharing) sees the same samples at more positions.
        if not _in_functorch_transform():
            self._pass += 1

    def _forward_hook(self, layer: KFACLayer) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            # evaluation (eval mode or no_grad) must not leak into the factors
            if not self._capturing or not module.training or not torch.is_grad_enabled():
                return
            # torch.func transforms (vmap, grad, jacrev) run the model on wrapped tensors
            # that must not outlive the transform: such a call is not a training step
            if _in_functorch_transform():
                return
            x = inputs[0]
            # a call starts a new pass when the model was called again, or when every
            # earlier call of this layer was backpropagated (the model's submodules
            # called directly, micro-batch after micro-batch); samples are counted once
            # per pass, so repeated calls within a pass are extra positions, not samples
            new = (
                self._layer_pass.get(layer.name) != self._pass
                or layer.forward_calls == layer.backward_calls
            )
            self._layer_pass[layer.name] = self._pass
            mask = layer.position_mask(x)
            with torch.no_grad():
                layer.add_a(x)
            if isinstance(output, Tensor) and output.requires_grad:
                batch = output.shape[0]
                samples = batch if new else 0
                # A tensor hook on the output, not a module backward hook: it survives an
                # in-place activation applied to the output afterwards (it receives the
                # gradient with respect to the value before the in-place op).
                output.register_hook(lambda go: self._backward(layer, go, batch, samples, mask))

        return hook

    def _backward(
        self,
        layer: KFACLayer,
        grad_output: Tensor,
        batch: int,
        samples: int,
        mask: Tensor | None,
    ) -> None:
        if self.config.loss_reduction == "mean":
            scale = float(batch * self.config.accumulation_steps)
        else:
            scale = 1.0
        with torch.no_grad():
            if mask is not None:
                # positions that do not reach the weight (Embedding padding) add nothing to G
                grad_output = grad_output * mask.unsqueeze(-1).to(grad_output.dtype)
            layer.add_g(grad_output, scale / self._grad_scale(), samples)

    def remove_hooks(self) -> None:
        """Detach K-FAC from the model (the layers keep their factors)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the step ----------------------------------------------------------------------
    @property
    def damping(self) -> float:
        """λ at the current step (the adaptive value if adaptive damping set one)."""
        if self.damping_override is not None:
            return self.damping_override
        return float(self.config.at("damping", self.steps))

    def _check_hooks(self, capture: bool) -> dict[str, Tensor]:
        grads: dict[str, Tensor] = {}
        for name, layer in self.layers.items():
            g = layer.grad()
            frozen = not layer.module.weight.requires_grad
            if g is None or frozen:
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"K-FAC layer {name!r} has no gradient at step {self.steps} (frozen with "
                        "requires_grad=False, or unused); it is not preconditioned while that "
                        "lasts.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                continue
            if capture:
                self._check_calls(name, layer)
            grads[name] = g
        return grads

    def _check_calls(self, name: str, layer: KFACLayer) -> None:
        f, b = layer.forward_calls, layer.backward_calls
        where = f"K-FAC layer {name!r} ({layer.kind})"
        if f == 0 and not layer.module.training:
            raise RuntimeError(
                f"{where} has a gradient but is in eval mode, so K-FAC gathered no statistics "
                "for it (eval-mode forwards are left out of the factors on purpose): call "
                "model.train() before the training forward, and model.eval() only for "
                f"evaluation. To keep its plain gradient, pass skip_layers=[{name!r}]."
            )
        if f == 0:
            raise RuntimeError(
                f"{where} has a gradient but its forward hook did not fire since the last "
                "step: the model uses its weight without calling the module (functional use, "
                "as nn.MultiheadAttention does with out_proj), or called it under "
                "torch.no_grad() or inside a torch.func transform. Pass "
                f"skip_layers=[{name!r}] to keep its plain gradient."
            )
        if b == 0:
            raise RuntimeError(
                f"{where} has a gradient and ran forward {f} time(s) since the last step, but "
                "no gradient reached its output: its output was detached or not used in the "
                "loss. To freeze the layer, set requires_grad=False on its parameters; to keep "
                f"its plain gradient, pass skip_layers=[{name!r}]."
            )
        if f != b:
            raise RuntimeError(
                f"{where} ran {f} training-mode forward call(s) but received {b} output "
                "gradient(s) since the last step: a forward that is not backpropagated (a "
                "metric or validation loss computed in training mode) would enter its factor "
                "A. Wrap extra forwards in torch.no_grad() or run them in eval mode "
                "(model.eval())."
            )

    def step(self) -> None:
        """Update factors and decompositions when due, then precondition every ``.grad``."""
        cfg = self.config
        step = self.steps
        # every scheduled value this step needs, read (and checked) before anything changes;
        # the next step's factor interval decides whether its forward is captured
        f_steps = cfg.at("factor_update_steps", step)
        i_steps = cfg.at("inv_update_steps", step)
        next_f_steps = cfg.at("factor_update_steps", step + 1)
        capture = step % f_steps == 0
        damping = self.damping
        decay = cfg.at("factor_decay", step)
        kl_clip = cfg.at("kl_clip", step)
        lr = cfg.at("lr", step)
        grads = self._check_hooks(capture)
        if capture:
            self._update_factors(decay)
        if step % i_steps == 0:
            self._update_inverses(damping, i_steps)
        pre = self._precondition(grads, damping)
        nu: float = 1.0
        if kl_clip is not None and pre:
            # the products in the gradient's dtype, their sum accumulated in float64
            vg = sum(float((pre[n] * grads[n]).sum(dtype=torch.float64)) for n in pre) * lr**2
            if vg != 0.0:
                nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
        for name, p in pre.items():
            self.layers[name].set_grad(p.mul_(nu) if nu != 1.0 else p)
        self.last_nu = nu
        self.steps += 1
        self._capturing = self.steps % next_f_steps == 0
        self._layer_pass.clear()
        for layer in self.layers.values():
            layer.reset_stats()

    def _update_factors(self, decay: float) -> None:
        layers = list(self.layers.values())
        packed = self.config.symmetry_aware
        tensors: list[Tensor] = []
        for layer in layers:
            for t in layer.stats():
                square = t.ndim == 3 and t.shape[-1] == t.shape[-2]
                tensors.append(_pack(t) if packed and square else t)
        counts = torch.tensor(
            [[layer.a_rows, layer.g_samples] for layer in layers], dtype=torch.float64
        )
        self.reducer.sum_([*tensors, counts])
        if not all(_all_finite(t) for t in tensors):
            # a GradScaler overflow: the optimizer step is skipped too
            self.skipped_factor_updates += 1
            return
        for i, layer in enumerate(layers):
            a, g = tensors[2 * i], tensors[2 * i + 1]
            a_shape, g_shape = layer.factor_shapes()
            if packed and len(a_shape) == 3:
                a = _unpack(a, a_shape[-1])
            if packed:
                g = _unpack(g, g_shape[-1])
            a_rows, g_samples = float(counts[i, 0]), float(counts[i, 1])
            if a_rows > 0 and g_samples > 0:
                layer.update_factors(a, a_rows, g, g_samples, decay)

    def _update_inverses(self, damping: float, uses: int) -> None:
        cfg = self.config
        asg, rank = self.assignment, self.reducer.rank
        for name, layer in self.layers.items():
            if asg.inverse_worker[name] == rank:
                layer.decompose(cfg.compute_method, damping, cfg.inv_dtype, uses)
        k = asg.grad_workers
        if k == 1:
            return
        block = rank // k
        for src in range(k):
            bufs = [
                t
                for name, layer in self.layers.items()
                if asg.inverse_worker[name] == block * k + src
                for t in layer.inverse_buffers(cfg.compute_method, cfg.inv_dtype, uses)
            ]
            if bufs:
                self._workers.broadcast_from_(bufs, src)

    def _precondition(self, grads: dict[str, Tensor], damping: float) -> dict[str, Tensor]:
        cfg = self.config
        asg, rank = self.assignment, self.reducer.rank
        out: dict[str, Tensor] = {}
        for name, g in grads.items():
            if asg.is_grad_worker(name, rank):
                out[name] = self.layers[name].precondition(g, cfg.compute_method, damping)
        blocks = asg.world_size // asg.grad_workers
        if blocks == 1:
            return out
        for b in range(blocks):
            bufs = []
            for name, g in grads.items():
                if asg.block(name) == b:
                    # a layer's result may be a padded view; collectives want it dense
                    out[name] = out[name].contiguous() if name in out else torch.empty_like(g)
                    bufs.append(out[name])
            if bufs:
                self._receivers.broadcast_from_(bufs, b)
        return {name: out[name] for name in grads}

    # -- reporting ---------------------------------------------------------------------
    def summary(self) -> str:
        """A table of the preconditioned layers and of the modules with plain gradients.

        Each preconditioned layer shows its factor shapes and the rank that decomposes
        it; each other module with parameters shows why it keeps its plain gradient.
        """
        lines = ["K-FAC preconditions:"]
        for name, layer in self.layers.items():
            a, g = layer.factor_shapes()
            lines.append(
                f"  {name:<30} {layer.kind:<10} A {tuple(a)}  G {tuple(g)}  "
                f"inverse on rank {self.assignment.inverse_worker[name]}"
            )
        lines.append("Plain gradients:" if self.skipped else "Plain gradients: none")
        for name, why in self.skipped.items():
            lines.append(f"  {name:<30} {why}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Steps, adaptive damping and every layer's factors and this rank's decompositions.

        Plain tensors, numbers and strings, so ``torch.load(..., weights_only=True)``
        reads it.  Factors are identical on every rank; decompositions are the ones
        this rank holds.
        """
        layers: dict[str, Any] = {}
        for name, layer in self.layers.items():
            entry: dict[str, Any] = {}
            if layer.A is not None and layer.G is not None:
                entry["A"] = layer.A.clone()
                entry["G"] = layer.G.clone()
            entry["inv"] = {k: v.clone() for k, v in layer.inv.items()}
            layers[name] = entry
        return {
            "steps": self.steps,
            "damping_override": self.damping_override,
            "skipped_factor_updates": self.skipped_factor_updates,
            "layers": layers,
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"K-FAC state_dict must be a dict, got {type(state).__name__}")
        missing = {"steps", "layers"} - set(state)
        if missing:
            raise ValueError(f"K-FAC state_dict lacks {sorted(missing)}")
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"K-FAC state_dict: steps={steps!r} must be an integer >= 0")
        override = state.get("damping_override")
        if override is not None:
            try:
                check_damping(override)
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"K-FAC state_dict: damping_override={override!r} must be a finite number "
                    "> 0 or None"
                ) from exc
        skipped = state.get("skipped_factor_updates", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(
                f"K-FAC state_dict: skipped_factor_updates={skipped!r} must be an integer >= 0"
            )
        if not isinstance(state["layers"], dict):
            raise TypeError("K-FAC state_dict: 'layers' must be a dict of layer name → entry")
        names = set(state["layers"])
        if names != set(self.layers):
            raise ValueError(
                f"K-FAC state_dict holds layers {sorted(names)} but this model's preconditioned "
                f"layers are {sorted(self.layers)}"
            )
        method = self.config.compute_method
        for name, entry in state["layers"].items():
            layer = self.layers[name]
            where = f"K-FAC state_dict: layer {name!r}"
            if not isinstance(entry, dict):
                raise TypeError(f"{where} entry must be a dict, got {type(entry).__name__}")
            if ("A" in entry) != ("G" in entry):
                have, lack = ("A", "G") if "A" in entry else ("G", "A")
                raise ValueError(f"{where} has factor {have} but no {lack}: both or neither")
            a_shape, g_shape = layer.factor_shapes()
            for key, shape in (("A", a_shape), ("G", g_shape)):
                if key in entry:
                    _check_tensor(where, f"factor {key}", entry[key], shape)
            inv = entry.get("inv", {})
            if not isinstance(inv, dict):
                raise TypeError(f"{where} 'inv' must be a dict, got {type(inv).__name__}")
            if not inv:
                continue  # no decomposition yet, or one this rank does not hold
            layouts = layer.inverse_layouts(method)
            layout = next((lay for lay in layouts if set(lay) == set(inv)), None)
            if layout is None:
                raise ValueError(
                    f"{where} holds decomposition {sorted(inv)}, which compute_method="
                    f"{method!r} cannot use (it expects one of "
                    f"{[sorted(lay) for lay in layouts]}); load it into a K-FAC built with the "
                    "compute_method that saved it."
                )
            for key, shape in layout.items():
                _check_tensor(where, f"decomposition {key}", inv[key], shape)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; every entry is checked before any is set."""
        self.check_state_dict(state)
        # read before assigning: a callable factor_update_steps may refuse the step count
        steps = int(state["steps"])
        capturing = steps % self.config.at("factor_update_steps", steps) == 0
        for name, entry in state["layers"].items():
            layer = self.layers[name]
            if "A" in entry:
                layer.A = entry["A"].to(layer.factor_dtype).clone()
                layer.G = entry["G"].to(layer.factor_dtype).clone()
            else:
                layer.A = layer.G = None
            layer.inv = {k: v.clone() for k, v in entry.get("inv", {}).items()}
        self.steps = steps
        override = state.get("damping_override")
        self.damping_override = None if override is None else float(override)
        self.skipped_factor_updates = int(state.get("skipped_factor_updates", 0))
        self._capturing = capturing


def _check_tensor(where: str, what: str, t: Any, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{where} {what} must be a floating tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where} {what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
