"""The forward and backward hooks that gather K-FAC's factor statistics.

A forward hook on each layer puts a tensor hook on its output; when the output's
gradient arrives, the call's input enters A and the gradient enters G, together.  A
forward that is never backpropagated (a metric computed in training mode, a pass
abandoned after an error, a backward interrupted before it reached the layer) leaves
both factors alone.  A forward pre-hook on the model counts its calls, so a layer
called several times in one call (weight sharing) counts its samples once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .config import KFACConfig
from .layers import KFACLayer

__all__ = ["StatsCapture", "check_calls", "in_functorch_transform"]


def in_functorch_transform() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (vmap, grad, jacrev)."""
    # torch.func exposes no public "am I inside a transform" test; the interpreter
    # stack is empty outside every vmap/grad/jacrev
    return torch._C._functorch.peek_interpreter_stack() is not None


class StatsCapture:
    """Hooks on a model that feed each layer's :meth:`~KFACLayer.add_pair` in training passes.

    Args:
        config: read for ``loss_reduction`` and ``accumulation_steps`` (G's scale).
        grad_scale: returns the current loss scale, divided out of G.
    """

    def __init__(self, config: KFACConfig, grad_scale: Callable[[], float]) -> None:
        self.config = config
        self.grad_scale = grad_scale
        #: whether this step's forwards enter the factors (a factor update is due).
        self.capturing = True
        #: calls of the model so far, and the call in which each layer last ran.
        self.passes = 0
        self.layer_pass: dict[str, int] = {}
        #: the pass (a number of its own) each layer's calls currently belong to.
        self.layer_call: dict[str, int] = {}
        self._next_call = 0
        #: steps taken: a gradient for a forward from before the last step is ignored.
        self.generation = 0
        #: a checkpoint was loaded and the model not called since: the next step has
        #: no statistics to check or fold in (those gathered before the load were
        #: dropped; their zeros leave the loaded factors as they are).
        self.loaded = False
        self.handles: list[RemovableHandle] = []

    def attach(self, model: nn.Module, layers: dict[str, KFACLayer]) -> None:
        """Register the model's pre-hook and every layer's forward hook."""
        self.handles = [model.register_forward_pre_hook(self._new_pass)]
        self.handles += [
            layer.module.register_forward_hook(self._forward_hook(layer), with_kwargs=True)
            for layer in layers.values()
        ]

    def remove(self) -> None:
        """Remove every hook this object registered."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def end_step(self, loaded: bool = False) -> None:
        """Forget which pass each layer last ran in (the next step starts afresh).

        ``loaded``: a checkpoint replaced the state, until the model is called again.
        """
        self.layer_pass.clear()
        self.layer_call.clear()
        self.generation += 1
        self.loaded = loaded

    def _new_pass(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        # One call of the model is one pass over its batch: a layer called several
        # times in it (weight sharing) sees the same samples at more positions.
        if not in_functorch_transform():
            self.passes += 1
            self.loaded = False

    def _pass_of(self, layer: KFACLayer) -> int:
        # A call starts a new pass when the model was called again, or when a call of
        # the current pass was already backpropagated (the model's submodules called
        # directly, micro-batch after micro-batch); samples are counted once per pass,
        # so repeated calls within a pass are extra positions, not samples.
        name = layer.name
        call = self.layer_call.get(name)
        if call is None or self.layer_pass.get(name) != self.passes or call in layer.counted:
            self._next_call += 1
            call = self._next_call
            self.layer_call[name] = call
        self.layer_pass[name] = self.passes
        return call

    def _forward_hook(self, layer: KFACLayer) -> Callable[..., None]:
        def hook(
            module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            # evaluation (eval mode or no_grad) must not leak into the factors
            if not self.capturing or not module.training or not torch.is_grad_enabled():
                return
            # torch.func transforms (vmap, grad, jacrev) run the model on wrapped tensors
            # that must not outlive the transform: such a call is not a training step
            if in_functorch_transform():
                return
            # Linear, Conv and Embedding name their input ``input``: lin(input=x) passes
            # it as a keyword, which a forward hook sees only with_kwargs
            given = inputs[0] if inputs else kwargs.get("input")
            if not isinstance(given, Tensor):
                return  # not a call K-FAC can read (check_calls names it at the step)
            layer.forward_calls += 1
            if not (isinstance(output, Tensor) and output.requires_grad):
                return
            # The input is kept (autograd keeps it too, for the weight's gradient) and
            # enters A only with the output's gradient.
            x = given.detach()
            call, generation = self._pass_of(layer), self.generation
            # A tensor hook on the output, not a module backward hook: it survives an
            # in-place activation applied to the output afterwards (it receives the
            # gradient with respect to the value before the in-place op).
            output.register_hook(lambda go: self._backward(layer, x, go, call, generation))

        # Under torch.compile the hook runs eagerly, between the compiled pieces: it
        # keeps real tensors and registers a real gradient hook (traced, it would see
        # fake tensors and its bookkeeping would not happen).
        return torch.compiler.disable(hook)

    def _backward(
        self, layer: KFACLayer, x: Tensor, grad_output: Tensor, call: int, generation: int
    ) -> None:
        if generation != self.generation:
            return  # a forward from before the last step
        batch = layer.batch_size(x)
        if self.config.loss_reduction == "mean":
            scale = float(batch * self.config.accumulation_steps)
        else:
            scale = 1.0
        samples = 0 if call in layer.counted else batch
        with torch.no_grad():
            mask = layer.position_mask(x)
            if mask is not None:
                # positions that do not reach the weight (Embedding padding) add nothing to G
                grad_output = grad_output * mask.unsqueeze(-1).to(grad_output.dtype)
            layer.add_pair(x, grad_output, scale / self.grad_scale(), samples)
        layer.counted.add(call)


def check_calls(name: str, layer: KFACLayer) -> None:
    """Raise if ``layer`` has a gradient but its hooks saw no backpropagated call of it."""
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
