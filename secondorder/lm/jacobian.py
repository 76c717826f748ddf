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
  ``vjp`` computes the same rows (for a small MLP about three times slower: its
  batched outer products run as many tiny matrix products).
* ``"forward"`` (per-sample forward mode, ``vmap`` over ``jvp``): one forward pass per
  parameter.  Wins only when a sample has more residuals than the model has
  parameters (small models with large outputs).
* ``"batch_reverse"`` / ``"batch_forward"``: differentiate the residual vector of
  the whole slice at once.  Needed when samples interact (BatchNorm in training mode
  normalises with batch statistics, so a per-sample Jacobian would be wrong) and for
  :class:`~secondorder.residuals.ModelResidual`.  Reverse costs one backward per
  residual of the slice, forward one forward per parameter; the cheaper is taken
  under ``"auto"``.

Per-sample strategies assume each sample's residuals depend on that sample only.
``"auto"`` checks its candidates on a probe of the batch and falls back to a
whole-batch mode; a strategy the user forced is wrapped in :class:`CheckedStrategy`,
which runs the same check once per input signature and raises instead of switching.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jacfwd, jacrev, vmap
from torch.utils._pytree import tree_flatten, tree_map

from . import conv_rows
from .carry import ForwardCarry
from .memory import BufferPool

__all__ = [
    "JACOBIANS",
    "PROBE_SAMPLES",
    "BatchForward",
    "BatchReverse",
    "CheckedStrategy",
    "CouplingError",
    "FactorGram",
    "JacobianStrategy",
    "LinearLayer",
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
    "linear_layers",
    "make_jacobian",
    "random_message",
    "record_trial",
    "unsupported_message",
]

Params = dict[str, Tensor]


@dataclass(frozen=True)
class LinearLayer:
    """An ``nn.Linear`` (or ``nn.Conv1d``/``nn.Conv2d``) layer and its trainable names."""

    module: nn.Linear | nn.Conv1d | nn.Conv2d
    weight: str | None
    bias: str | None


def linear_layers(
    model: nn.Module, names: Sequence[str], params: Sequence[Tensor]
) -> tuple[LinearLayer, ...] | None:
    """The layers holding the trainable ``params``, if each is a Linear, Conv1d or Conv2d.

    Returns ``None`` when a trainable parameter lives in any other module (a
    normalisation, a 3-D convolution, a custom module, a subclass that may change its
    forward): the per-sample reverse strategy then uses ``vmap``.
    """
    canonical = {id(p): name for name, p in zip(names, params, strict=True)}
    layers: list[LinearLayer] = []
    covered: set[str] = set()
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in canonical]
        if not own:
            continue
        if type(module) is not nn.Linear and not conv_rows.is_conv(module):
            return None
        assert isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d))
        weight = canonical.get(id(module.weight))
        bias = None if module.bias is None else canonical.get(id(module.bias))
        layers.append(LinearLayer(module, weight, bias))
        covered.update(n for n in (weight, bias) if n is not None)
    if covered != set(names):
        return None
    return tuple(layers)


#: A layer's rows are taken from its factors only where its J block holds at least
#: this many times the factors' entries (fan_out·fan_in against fan_out + fan_in).
_FACTOR_GAIN = 4
#: ... and only for slices of J with at least this many entries: below, a pass over J
#: costs about what the products' dozen extra operations do (measured at 256 × 1,370).
#: (J Jᵀ from the factors, :class:`FactorGram`, has no such floor.)
_FACTOR_MIN_ENTRIES = 1 << 20


@dataclass(frozen=True)
class _Factors:
    """One ``nn.Linear`` call's rows for residual j: ``g_i a_iᵀ`` (weight) and ``g_i`` (bias)."""

    weight: int | None  # J's first column of the weight block, if trainable
    bias: int | None  # J's first column of the bias block, if trainable
    g: Tensor  # (batch, fan_out): ∂r_ij/∂z_i
    a: Tensor  # (batch, fan_in): the layer's input
    r: Tensor  # (batch,): r_ij


@dataclass(frozen=True)
class RowSums:
    """What :meth:`RowProducts.take` hands out for one slice's rows.

    Attributes:
        grad: ``Jᵀr``; ``None`` when ``augmented`` is handed out instead.
        col_sq: ``diag(JᵀJ)`` when asked for, else ``None``.
        outer: ``J Jᵀ`` from the layers' factors (:class:`FactorGram`) when every
            column of J is one outer product per row, else ``None``.
        augmented: ``[J r]`` (rows × (n + 1)), the buffer J lives in with r as its
            last column, when asked for: the Gram of it carries ``JᵀJ`` and ``Jᵀr``
            in one product, without a pass over J for ``Jᵀr``.
    """

    grad: Tensor | None
    col_sq: Tensor | None
    outer: FactorGram | None
    augmented: Tensor | None = None


class FactorGram:
    """``J Jᵀ`` (m × m) of outer-product rows, from the layers' factors.

    Row i of J holds ``vec(gᵢaᵢᵀ)`` and ``gᵢ`` for each layer, so
    ``Jᵢ·Jⱼ = Σ_layers (gᵢ·gⱼ)(aᵢ·aⱼ + 1)`` (the 1 for the bias): a Hadamard product
    of two small Grams per layer, m²(fan_out + fan_in) multiply-adds where the
    product of J's rows costs m²·n.  The few columns that are not one outer product
    per row (a convolution's, a narrow layer's) add their own block's product.  Cheap
    enough in float64 at any λ.
    """

    def __init__(
        self, factors: list[_Factors], rows: Tensor, blocks: list[tuple[int, int]]
    ) -> None:
        self.factors, self.rows, self.blocks = factors, rows, blocks

    def __call__(self, dtype: torch.dtype) -> Tensor:
        """``J Jᵀ`` in ``dtype``."""
        m = self.rows.shape[0]
        out = torch.zeros(m, m, dtype=dtype, device=self.rows.device)
        for lo, hi in self.blocks:
            block = self.rows[:, lo:hi].to(dtype)
            out.addmm_(block, block.T)
        for f in self.factors:
            if f.weight is None and f.bias is None:
                continue  # both blocks are read from J (a layer called twice, say)
            g = f.g.to(dtype)
            gg = g @ g.T
            if f.weight is None:
                out += gg  # the bias alone: its rows are gᵢ
                continue
            a = f.a.to(dtype)
            aa = a @ a.T
            if f.bias is not None:
                aa += 1.0
            out += gg * aa
        return out


class RowProducts:
    """``Jᵀr`` and ``diag(JᵀJ)`` of the rows the outer-product rule last wrote.

    A linear layer's rows are outer products ``g_i a_iᵀ``, so their products with r
    and their squared column norms are small products of the layer's factors:
    ``Σᵢ rᵢ gᵢ aᵢᵀ = gᵀ diag(r) a`` and ``Σᵢ gᵢ² (aᵢ²)ᵀ``, with batch × (fan_out +
    fan_in) reads instead of a pass over J's batch × fan_out × fan_in entries.  Blocks
    that are sums of outer products (a layer called twice, convolution windows, extra
    dimensions between the batch and the features) are read from J's columns, and so
    is all of a small J (below :data:`_FACTOR_MIN_ENTRIES` a pass costs about what the
    products' extra operations do).  Where every column is a factor's, ``J Jᵀ`` comes
    from the factors too (:class:`FactorGram`).

    The rule records its factors with the rows it returns; :meth:`take` hands the
    products out once, for those rows only (recognised by identity, held weakly so
    that the rows' pooled buffer is not kept busy).
    """

    def __init__(self) -> None:
        self._rows: weakref.ref[Tensor] | None = None
        self._factors: list[_Factors] = []
        self._from_rows: list[tuple[int, int]] = []
        self._r: Tensor | None = None

    def record(
        self,
        rows: Tensor,
        r: Tensor,
        factors: list[_Factors],
        from_rows: list[tuple[int, int]],
    ) -> None:
        """Remember ``rows`` (J, 2-D), ``r`` and how J's column ranges were written.

        ``rows`` are the first n columns of a buffer whose last column is r.
        """
        self._rows = weakref.ref(rows)
        self._r, self._factors, self._from_rows = r, factors, from_rows

    def clear(self) -> None:
        """Forget the last rows (a strategy that returned other rows)."""
        self._rows, self._r = None, None
        self._factors, self._from_rows = [], []

    def take(
        self, rows: Tensor, col_sq: bool, outer: bool = False, augmented: bool = False
    ) -> RowSums | None:
        """:class:`RowSums` for ``rows`` if the rule recorded them, else ``None``.

        ``outer``: whether to hand out ``J Jᵀ`` too (it holds the rows: ask only where
        they are kept anyway, as the dual form keeps them).  ``augmented``: hand out
        ``[J r]`` in place of ``Jᵀr`` (for a Gram of one slice).
        """
        held = None if self._rows is None else self._rows()
        r, factors, from_rows = self._r, self._factors, self._from_rows
        self.clear()
        if held is None or held is not rows or r is None:
            return None
        m, n = rows.shape
        if augmented and rows.stride() == (n + 1, 1):
            # [J r]: the same storage, one column wider (the rule wrote r there).
            wide = rows.as_strided((m, n + 1), (n + 1, 1), rows.storage_offset())
            return RowSums(None, None, None, wide)
        if not factors:
            return None  # one pass over J each, as the caller makes them
        # One residual per sample and at most a quarter of the columns read from J:
        # J Jᵀ from the factors.
        read = sum(hi - lo for lo, hi in from_rows)
        per_sample = all(f.g.shape[0] == rows.shape[0] for f in factors)
        gram = (
            FactorGram(factors, rows, from_rows) if outer and per_sample and 4 * read <= n else None
        )
        if rows.numel() < _FACTOR_MIN_ENTRIES:
            return RowSums(rows.T @ r, (rows * rows).sum(0) if col_sq else None, gram)
        grad = torch.zeros(n, dtype=rows.dtype, device=rows.device)
        col = torch.zeros(n, dtype=rows.dtype, device=rows.device) if col_sq else None
        for f in factors:
            _add_products(f, grad, col)
        for lo, hi in from_rows:
            block = rows[:, lo:hi]
            grad[lo:hi] += block.T @ r
            if col is not None:
                col[lo:hi] += (block * block).sum(0)
        return RowSums(grad, col, gram)


def _add_products(f: _Factors, grad: Tensor, col: Tensor | None) -> None:
    """Add one layer call's ``gᵀ diag(r) a``, ``gᵀr`` (and squared norms) into the vectors.

    The scaled factor is the narrower one, and the bias rides along as a column of
    ones (or a sum), so the wider factor is read once per vector.
    """
    g, a, r = f.g, f.a, f.r
    fan_out, fan_in = g.shape[1], a.shape[1]
    wsize = fan_out * fan_in
    for target, gg, aa, rr in (
        (grad, g, a, r),
        (col, None if col is None else g * g, None if col is None else a * a, None),
    ):
        if target is None or gg is None or aa is None:
            continue
        if fan_out <= fan_in:
            left = gg if rr is None else gg * rr[:, None]
            if f.weight is not None:
                target[f.weight : f.weight + wsize].view(fan_out, fan_in).addmm_(left.T, aa)
            if f.bias is not None:
                target[f.bias : f.bias + fan_out] += left.sum(0)
            continue
        right = aa if rr is None else aa * rr[:, None]
        ones = torch.ones_like(right[:, :1]) if rr is None else rr[:, None]
        # (narrow)ᵀ·(wide), then transposed: a thin right operand runs far below
        # the matrix-multiply kernel's speed (measured 5x slower at 2 columns).
        both = torch.cat([right, ones], 1).T @ gg
        if f.weight is not None:
            target[f.weight : f.weight + wsize].view(fan_out, fan_in).add_(both[:fan_in].T)
        if f.bias is not None:
            target[f.bias : f.bias + fan_out] += both[fan_in]


@dataclass(frozen=True)
class ResidualProgram:
    """The residuals of a problem as pure functions of the parameters.

    Attributes:
        per_sample: ``f(params, x_i, y_i) -> r_i`` (1-D) for one sample without its
            batch dimension, or ``None`` when samples cannot be separated.
        batch: ``f(params, X, Y) -> r`` (1-D) for a whole slice.
        order: parameter names in the order of J's columns.
        targets_batched: whether targets carry a batch dimension to slice.
        layers: the model's ``nn.Linear``/``nn.Conv1d``/``nn.Conv2d`` layers when they
            hold every trainable parameter (:func:`linear_layers`), which ``"reverse"``
            then differentiates by the outer-product rule; ``None`` otherwise.
        verified: per input signature, whether the outer-product rule matched
            ``vmap`` on the first slice of that signature (filled in by the strategy).
        random_modules: the model's dropout modules; the outer-product rule refuses a
            forward pass that calls one in training mode (as ``vmap`` does), through
            hooks on these modules only (a global module hook would make
            ``torch.compile`` of the user's model warn and fall back).
        checked: per strategy and input signature, whether :class:`CheckedStrategy`
            has checked a forced strategy on this program (the probe's size).
        rows_pool: the buffer the outer-product rule writes J's rows into, reused
            from step to step while nothing else holds it (:class:`BufferPool`).
        row_products: ``Jᵀr`` and ``diag(JᵀJ)`` of the rule's last rows, from the
            layers' factors (:class:`RowProducts`).
        forward, residual: ``batch`` in two parts, ``residual(forward(params, X), Y)``
            (``None`` where the residual function needs the model itself).
        carry: the last trial's forward pass for the next linearisation
            (:class:`~secondorder.lm.carry.ForwardCarry`; ``None``: never kept).
    """

    per_sample: Callable[[Params, Any, Any], Tensor] | None
    batch: Callable[[Params, Any, Any], Tensor]
    order: tuple[str, ...]
    targets_batched: bool = True
    layers: tuple[LinearLayer, ...] | None = None
    verified: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    random_modules: tuple[nn.Module, ...] = ()
    checked: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    rows_pool: BufferPool = field(default_factory=BufferPool, compare=False, repr=False)
    row_products: RowProducts = field(default_factory=RowProducts, compare=False, repr=False)
    forward: Callable[[Params, Any], Tensor] | None = None
    residual: Callable[[Tensor, Any], Tensor] | None = None
    carry: ForwardCarry | None = field(default=None, compare=False, repr=False)


def _with_aux(f: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, Tensor]]:
    def g(*args: Any) -> tuple[Tensor, Tensor]:
        r = f(*args)
        return r, r

    return g


def _flatten(jac: dict[str, Tensor], order: tuple[str, ...], rows: int) -> Tensor:
    return torch.cat([jac[name].reshape(rows, -1) for name in order], dim=1)


class JacobianStrategy:
    """Base class: compute ``(J, r)`` for one slice."""

    name = ""
    #: Whether the strategy treats samples separately (and so may slice the batch).
    per_sample = True

    def __call__(
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        """Return J (rows × parameters) and r (rows) of this slice."""
        raise NotImplementedError


def _per_sample_fn(program: ResidualProgram) -> Callable[[Params, Any, Any], Tensor]:
    if program.per_sample is None:
        raise ValueError(
            "This residual couples samples (a ModelResidual or a model whose samples "
            "interact); use jacobian='batch_reverse' or 'batch_forward'."
        )
    return program.per_sample


class _UnsupportedError(Exception):
    """The outer-product rule does not apply to this model or batch."""


def _leading(tree: Any) -> int:
    sizes = {int(t.shape[0]) for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.ndim}
    if len(sizes) != 1:
        raise _UnsupportedError
    return sizes.pop()


def _signature(inputs: Any, targets: Any) -> str:
    leaves = tree_flatten((inputs, targets))[0]
    return "|".join(
        f"{tuple(t.shape[1:])}{t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        for t in leaves
    )


_Call = tuple[LinearLayer, Tensor, Tensor]


@contextlib.contextmanager
def _recording(program: ResidualProgram) -> Iterator[list[_Call]]:
    """Hooks on the program's layers for one forward pass: each call's (layer, input, output)."""
    assert program.layers is not None
    layer_of = {id(layer.module): layer for layer in program.layers}
    calls: list[_Call] = []

    def record(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if len(args) != 1 or not isinstance(args[0], Tensor) or not isinstance(out, Tensor):
            raise _UnsupportedError
        calls.append((layer_of[id(module)], args[0], out))

    def refuse_randomness(module: nn.Module, args: Any) -> None:
        # vmap refuses random modules; so does this rule, and vmap then says why.
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p:
            raise _UnsupportedError

    handles = [layer.module.register_forward_hook(record) for layer in program.layers]
    handles += [m.register_forward_pre_hook(refuse_randomness) for m in program.random_modules]
    try:
        with torch.enable_grad():
            yield calls
    finally:
        for h in handles:
            h.remove()


def _record_calls(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> tuple[list[_Call], Tensor, Params]:
    """One forward pass of the slice: each layer call's (layer, input, output), r, leaves.

    The pass the last accepted trial recorded (:func:`record_trial`) stands in for
    a new one where :meth:`ForwardCarry.take` finds it still valid.
    """
    carry = program.carry
    kept = None if carry is None else carry.take(params, inputs)
    if kept is not None:
        assert program.residual is not None
        with torch.enable_grad():
            return kept.calls, program.residual(kept.out, targets), kept.leaves
    with _recording(program) as calls:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        r = program.batch(leaves, inputs, targets)
    return calls, r, leaves


def record_trial(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any, point: Tensor
) -> Tensor:
    """The residuals at a trial point, its forward pass kept for the next linearisation.

    ``params``: the flat trial ``point`` unflattened.

    The pass is recorded as :func:`_record_calls` records one (hooks on the layers,
    autograd on) and kept by ``program.carry`` (:class:`ForwardCarry`) with what it
    depends on; the residuals are the same numbers ``program.batch`` gives, the
    residual function run without autograd as in any trial.  Where the
    model's state cannot be compared (:func:`~secondorder.lm.carry.model_state`) or
    the rule does not apply, the point is evaluated plainly and nothing is kept.
    """
    carry, forward, residual = program.carry, program.forward, program.residual
    state = None if carry is None else carry.state()
    if carry is None or forward is None or residual is None or state is None:
        with torch.no_grad():
            return program.batch(params, inputs, targets)
    try:
        with _recording(program) as calls:
            # Copies: the graph must not see the caller's buffer for the point change.
            leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
            out = forward(leaves, inputs)
    except _UnsupportedError:
        with torch.no_grad():
            return program.batch(params, inputs, targets)
    version = out._version
    with torch.no_grad():
        # As for any trial: the residual function runs without autograd (the
        # linearisation applies it again, to the kept output, with autograd).
        r = residual(out, targets)
    if out._version == version:
        carry.keep(point, leaves, inputs, state, calls, out)
    else:  # the residual function wrote into the model's output: keep nothing
        carry.discard()
    return r


def _layer_outputs(calls: list[_Call], batch: int) -> list[Tensor]:
    """The calls' outputs; refuse a call whose shapes are not ``z = a Wᵀ (+ b)``."""
    outs = []
    for layer, a, z in calls:
        w = layer.module.weight
        if conv_rows.is_conv(layer.module):
            if not conv_rows.check_call(layer.module, a, z, batch):
                raise _UnsupportedError
        elif (
            a.shape[0] != batch
            or z.shape[:-1] != a.shape[:-1]
            or w.shape
            != (
                z.shape[-1],
                a.shape[-1],
            )
        ):
            raise _UnsupportedError
        outs.append(z)
    return outs


def _autograd_sums(
    rk: Tensor, leaves: Params, order: tuple[str, ...], k: int
) -> list[tuple[int, Tensor, Tensor]]:
    """For each residual j, ``(j, v, Σᵢ vᵢ ∂r_ij/∂θ)`` by autograd, random ``vᵢ ∈ {½, 1, 2}``."""
    checks: list[tuple[int, Tensor, Tensor]] = []
    gen = torch.Generator().manual_seed(0)
    v = (2.0 ** torch.randint(-1, 2, (rk.shape[0],), generator=gen)).to(rk)
    for j in range(k):
        total = torch.autograd.grad(
            (rk[:, j] * v).sum(), [leaves[name] for name in order],
            retain_graph=True, allow_unused=True,
        )  # fmt: skip
        flat = torch.cat(
            [
                (torch.zeros_like(leaves[name]) if t is None else t).reshape(-1)
                for name, t in zip(order, total, strict=True)
            ]
        )
        checks.append((j, v, flat.detach()))
    return checks


def _fill_rows(
    jac: Tensor,
    rk: Tensor,
    calls: list[_Call],
    outs: list[Tensor],
    starts: dict[str, int],
    factors: list[_Factors],
    from_rows: set[str],
) -> set[tuple[int, str]]:
    """Write ``g_i a_iᵀ`` and ``g_i`` into ``jac[i, j]``; return the (j, name) blocks written.

    Each block written as one outer product per sample has its factors appended to
    ``factors``; the names of the other blocks are added to ``from_rows``.
    """
    batch, k = rk.shape
    written: set[tuple[int, str]] = set()
    for j in range(k):
        grads = torch.autograd.grad(rk[:, j].sum(), outs, retain_graph=j < k - 1, allow_unused=True)
        for (layer, a, _), g in zip(calls, grads, strict=True):
            if g is None:
                continue
            names = [n for n in (layer.weight, layer.bias) if n is not None]
            if conv_rows.is_conv(layer.module):
                _conv_rows(jac[:, j], layer, a.detach(), g.detach(), starts, j, written)
                from_rows.update(names)
                continue
            fan_out, fan_in = layer.module.weight.shape
            g3 = g.detach().reshape(batch, -1, fan_out)
            a3 = a.detach().reshape(batch, -1, fan_in)
            single = g3.shape[1] == 1
            wide = fan_out * fan_in >= _FACTOR_GAIN * (fan_out + fan_in)
            if single and wide and all((j, n) not in written for n in names):
                factors.append(
                    _Factors(
                        weight=None if layer.weight is None else starts[layer.weight],
                        bias=None if layer.bias is None else starts[layer.bias],
                        g=g3[:, 0],
                        a=a3[:, 0],
                        r=rk[:, j].detach(),
                    )
                )
            else:
                from_rows.update(names)
            if layer.weight is not None:
                s = starts[layer.weight]
                block = jac[:, j, s : s + fan_out * fan_in].view(batch, fan_out, fan_in)
                first = (j, layer.weight) not in written
                if single and first:
                    torch.mul(g3[:, 0, :, None], a3[:, 0, None, :], out=block)
                elif single:
                    block.addcmul_(g3[:, 0, :, None], a3[:, 0, None, :])
                else:
                    block.baddbmm_(g3.transpose(1, 2), a3, beta=0.0 if first else 1.0)
                written.add((j, layer.weight))
            if layer.bias is not None:
                s = starts[layer.bias]
                block = jac[:, j, s : s + fan_out]
                gb = g3[:, 0] if single else g3.sum(1)
                if (j, layer.bias) in written:
                    block.add_(gb)
                else:
                    block.copy_(gb)
                written.add((j, layer.bias))
    return written


def _conv_rows(
    rows: Tensor,
    layer: LinearLayer,
    a: Tensor,
    g: Tensor,
    starts: dict[str, int],
    j: int,
    written: set[tuple[int, str]],
) -> None:
    """Write a convolution's rows for residual j (im2col patches times ``g``)."""
    module = layer.module
    if layer.weight is not None:
        s, size = starts[layer.weight], module.weight.numel()
        first = (j, layer.weight) not in written
        conv_rows.weight_rows(module, a, g, out=rows[:, s : s + size], accumulate=not first)
        written.add((j, layer.weight))
    if layer.bias is not None:
        s = starts[layer.bias]
        gb = conv_rows.bias_rows(module, g)
        block = rows[:, s : s + gb.shape[1]]
        if (j, layer.bias) in written:
            block.add_(gb)
        else:
            block.copy_(gb)
        written.add((j, layer.bias))


def _verdict(jac: Tensor, r: Tensor, checks: list[tuple[int, Tensor, Tensor]]) -> Tensor:
    """(finite, agree): a check on non-finite numbers decides nothing."""
    eps = torch.finfo(jac.dtype).eps
    finite = torch.isfinite(r).all()
    agree = torch.ones((), dtype=torch.bool, device=jac.device)
    for j, v, autograd_sum in checks:
        rows = jac[:, j, :]
        finite = finite & torch.isfinite(rows).all() & torch.isfinite(autograd_sum).all()
        scale = rows.abs().T @ v + torch.finfo(jac.dtype).tiny
        agree = agree & ((rows.T @ v - autograd_sum).abs() <= eps**0.5 * scale).all()
    return torch.stack([finite, agree])


def _linear_rule(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any, verify: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-sample rows of J for a model whose trainable parameters are all in nn.Linear.

    One forward pass of the whole slice records each layer call's input ``a`` and
    output ``z``; for each of the k residuals of a sample, one backward pass gives
    ``g = ∂r_j/∂z`` (samples are independent, so row i of g belongs to sample i) and
    the rows are ``∂r_ij/∂W = g_i a_iᵀ`` (summed over any dimensions between the
    batch and the features) and ``∂r_ij/∂b = g_i``.

    With ``verify``, one more backward pass computes ``Σᵢ vᵢ ∂r_ij/∂θ`` by autograd
    for random weights ``vᵢ ∈ {½, 1, 2}``, and the third result holds two booleans:
    whether the numbers are finite, and whether ``Jᵀv`` agrees with it (a parameter
    used outside its layer's forward would add a term the rows miss).
    """
    assert program.layers is not None
    batch = _leading(inputs)
    shapes = {k: v.shape for k, v in params.items()}
    numels = [shapes[k].numel() for k in program.order]
    starts = dict(zip(program.order, [sum(numels[:i]) for i in range(len(numels))], strict=True))
    n = sum(numels)
    calls, r, leaves = _record_calls(program, params, inputs, targets)
    if not calls or r.numel() % batch:
        raise _UnsupportedError
    k = r.numel() // batch
    outs = _layer_outputs(calls, batch)
    p0 = next(iter(params.values()))
    # J's rows with one more column, for r: the Gram of [J r] carries Jᵀr (RowSums).
    buffer = program.rows_pool.take((batch, k, n + 1), p0.dtype, p0.device)
    jac = buffer[..., :n]
    rk = r.view(batch, k)
    checks = _autograd_sums(rk, leaves, program.order, k) if verify else []
    factors: list[_Factors] = []
    from_rows: set[str] = set()
    written = _fill_rows(jac, rk, calls, outs, starts, factors, from_rows)
    for j in range(k):
        for name, size in zip(program.order, numels, strict=True):
            if (j, name) not in written:
                jac[:, j, starts[name] : starts[name] + size] = 0.0
    verdict = _verdict(jac, r, checks) if verify else None
    rows, r = jac.view(batch * k, n), r.detach()
    buffer[..., n] = rk.detach()
    # A block read from J's columns is read whole (its factors dropped); adjacent
    # blocks are read as one.
    size_of = dict(zip(program.order, numels, strict=True))
    read: list[tuple[int, int]] = []
    for lo, hi in sorted((starts[name], starts[name] + size_of[name]) for name in from_rows):
        if read and read[-1][1] == lo:
            lo = read.pop()[0]
        read.append((lo, hi))
    skip = {starts[name] for name in from_rows}
    kept = [
        replace(
            f,
            weight=None if f.weight in skip else f.weight,
            bias=None if f.bias in skip else f.bias,
        )
        for f in factors
    ]
    program.row_products.record(rows, r, kept, read)
    return rows, r, verdict


def _fast_rows(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> tuple[Tensor, Tensor] | None:
    """The outer-product rule's ``(J, r)``, or None where it does not apply.

    The first slice of each input signature is checked (one host synchronisation,
    once): a model that uses a layer's weight outside the layer's forward fails the
    check and keeps ``vmap``.  A slice with non-finite numbers decides nothing (its
    rows are returned, and the step that sees them is rejected); the next is checked.
    """
    sig = _signature(inputs, targets)
    ok = program.verified.get(sig)
    if ok is False:
        return None
    try:
        jac, r, agree = _linear_rule(program, params, inputs, targets, verify=ok is None)
    except _UnsupportedError:
        program.verified[sig] = False
        return None
    if agree is not None:
        finite, same = agree.tolist()
        if finite:
            program.verified[sig] = same
            if not same:
                _refuse_coupling(program, params, inputs, targets)
                return None
    return jac, r


def _refuse_coupling(program: ResidualProgram, params: Params, inputs: Any, targets: Any) -> None:
    """Raise if the outer-product rule failed its check because samples interact.

    The rule's rows disagree with autograd either because a weight is used outside
    its layer (``vmap`` is then right) or because samples interact, which ``vmap``
    gets just as wrong.  Compare ``vmap``'s rows with the whole slice evaluated at
    once (two evaluations and one backward pass, once per signature) and raise in
    the second case.
    """
    reference = batch_reference(program, params, inputs, targets)
    verdict = check_strategy(_VmapReverse(), program, params, inputs, targets, reference)
    if verdict.status == "coupled":
        raise CouplingError("reverse", verdict.detail)


class CouplingError(ValueError):
    """A per-sample strategy met samples that interact (see :func:`coupling_message`)."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(coupling_message(name, detail))
        self.detail = detail


def coupling_message(name: str, detail: str) -> str:
    """The error for a per-sample strategy on samples that interact."""
    return (
        f"jacobian={name!r} would compute a wrong Jacobian: {detail} when the samples are "
        "evaluated one at a time, so the samples of this batch interact (a residual_fn "
        "that subtracts a batch mean, a module computing x - x.mean(0), "
        "F.batch_norm(training=True), ...). Use jacobian='batch_reverse' or "
        "'batch_forward', or 'auto', which checks and switches to them."
    )


class PerSampleReverse(JacobianStrategy):
    """Per-sample reverse mode: cost ∝ residuals per sample.

    Models made of ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers (and
    parameter-free modules) get the outer-product rule; any other model, ``vmap`` over
    ``jacrev``.
    """

    name = "reverse"

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        _per_sample_fn(program)  # refuses a coupled residual before any work
        if program.layers is not None:
            fast = _fast_rows(program, params, inputs, targets)
            if fast is not None:
                return fast
        return _VmapReverse()(program, params, inputs, targets)


class _VmapReverse(JacobianStrategy):
    """``vmap`` over samples of ``jacrev``, for any per-sample residual."""

    name = "reverse"

    def __call__(
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        f = _per_sample_fn(program)
        y_dim = 0 if program.targets_batched and targets is not None else None
        jac, r = vmap(jacrev(_with_aux(f), has_aux=True), in_dims=(None, 0, y_dim))(
            params, inputs, targets
        )
        r = r.reshape(-1)
        return _flatten(jac, program.order, r.numel()), r


class PerSampleForward(JacobianStrategy):
    """``vmap`` over samples of forward-mode ``jacfwd``: cost ∝ parameters."""

    name = "forward"

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        f = _per_sample_fn(program)
        y_dim = 0 if program.targets_batched and targets is not None else None
        jac, r = vmap(jacfwd(_with_aux(f), has_aux=True), in_dims=(None, 0, y_dim))(
            params, inputs, targets
        )
        r = r.reshape(-1)
        return _flatten(jac, program.order, r.numel()), r


class BatchReverse(JacobianStrategy):
    """Reverse mode over the whole slice: one backward per residual, in chunks."""

    name = "batch_reverse"
    per_sample = False

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = chunk_size

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        jac, r = jacrev(_with_aux(program.batch), has_aux=True, chunk_size=self.chunk_size)(
            params, inputs, targets
        )
        return _flatten(jac, program.order, r.numel()), r


class BatchForward(JacobianStrategy):
    """Forward mode over the whole slice: one forward pass per parameter."""

    name = "batch_forward"
    per_sample = False

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        jac, r = jacfwd(_with_aux(program.batch), has_aux=True)(params, inputs, targets)
        return _flatten(jac, program.order, r.numel()), r


JACOBIANS = ("auto", "reverse", "forward", "batch_reverse", "batch_forward")


def make_jacobian(name: str, chunk_size: int | None = None) -> JacobianStrategy:
    """Build the strategy called ``name``; ``"auto"`` is resolved by the optimizer."""
    if name == "reverse":
        return PerSampleReverse()
    if name == "forward":
        return PerSampleForward()
    if name == "batch_reverse":
        return BatchReverse(chunk_size)
    if name == "batch_forward":
        return BatchForward()
    raise ValueError(f"Unknown jacobian={name!r}; valid choices are {JACOBIANS}.")


# -- checking a strategy on a probe of the batch ------------------------------------------
#: Samples a strategy is checked on (once per input signature): enough for samples to
#: interact, few enough that the check costs about one step on eight samples.
PROBE_SAMPLES = 8


class ResidualsIndependentError(ValueError):
    """The residuals do not depend on the model's trainable parameters."""


@dataclass(frozen=True)
class Reference:
    """The whole-batch evaluation a strategy is checked against.

    Attributes:
        residuals: ``r`` of the probe, evaluated on the whole probe at once.
        weights: one weight per residual, ``±{½, 1, 2}`` (fixed seed, not all equal).
        weighted_grad: ``Σᵢ wᵢ ∂rᵢ/∂θ`` by one backward pass of the whole probe.
        repeatable: whether a second evaluation gave the same residuals (not the case
            with Dropout in training mode or another random operation).
    """

    residuals: Tensor
    weights: Tensor
    weighted_grad: Tensor
    repeatable: bool


def _close(a: Tensor, b: Tensor, scale: Tensor) -> Tensor:
    """``‖a - b‖∞ ≤ √ε · scale`` (a 0-d bool): rounding passes, a coupling term does not."""
    eps = torch.finfo(a.dtype).eps
    return (a - b).abs().max() <= eps**0.5 * scale + torch.finfo(a.dtype).tiny


def _tracked(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> tuple[Params, Tensor]:
    """The residuals of the whole slice at leaves that require grad, and the leaves.

    Raises :class:`ResidualsIndependentError` when they carry no gradient.
    """
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        r = program.batch(leaves, inputs, targets)
    if not r.requires_grad:
        call = (
            "residual_fn(model(inputs), targets)"
            if program.per_sample is not None
            else "the ModelResidual's fn(model, inputs, targets)"
        )
        raise ResidualsIndependentError(
            "the residuals do not depend on the model's trainable parameters: "
            f"{call} returned a tensor with no gradient (requires_grad=False), so J "
            "would be zero and the fit would stop at once with a false convergence. "
            "residual_fn must compute its output from the model's output with torch "
            "operations (no .detach(), .item(), .numpy() or torch.no_grad())."
        )
    return leaves, r


def batch_reference(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> Reference:
    """Evaluate the probe as one batch: two forward passes and one backward pass.

    Raises :class:`ResidualsIndependentError` when the residuals carry no gradient to
    the parameters (a ``residual_fn`` that detaches, or that computes through NumPy or
    ``.item()``): no Jacobian strategy could be right.
    """
    leaves, r = _tracked(program, params, inputs, targets)
    gen = torch.Generator().manual_seed(0)
    w = 2.0 ** torch.randint(-1, 2, (r.numel(),), generator=gen).double()
    w = w * (1 - 2 * torch.randint(0, 2, (r.numel(),), generator=gen)).double()
    if r.numel() > 1:
        w[0], w[1] = 1.0, -0.5  # never all equal: a constant weight hides a mean's term
    w = w.to(r)
    total = torch.autograd.grad(
        (r * w).sum(), [leaves[k] for k in program.order], allow_unused=True
    )
    flat = torch.cat(
        [
            # An Embedding(sparse=True) gives a sparse gradient.
            (
                torch.zeros_like(leaves[k]) if t is None else t.to_dense() if t.is_sparse else t
            ).reshape(-1)
            for k, t in zip(program.order, total, strict=True)
        ]
    )
    with torch.enable_grad():
        # Evaluated as the first was (a residual_fn may branch on grad mode).
        again = program.batch(leaves, inputs, targets).detach()
    r = r.detach()
    scale = r.abs().max() if r.numel() else torch.zeros((), dtype=r.dtype)
    # Non-finite numbers decide nothing: such a probe counts as repeatable.
    repeatable = again.shape != r.shape or bool(
        ~torch.isfinite(r).all() | ~torch.isfinite(again).all() | _close(again, r, scale)
    )
    return Reference(r, w, flat.detach(), repeatable)


@dataclass(frozen=True)
class ProbeVerdict:
    """What checking one strategy on a probe found.

    ``status`` is ``"ok"``; ``"coupled"`` (the strategy ran but its residuals or rows
    differ from the whole-batch evaluation: samples interact); ``"failed"`` (it
    raised; ``detail`` holds the error); or ``"undecided"`` (non-finite numbers, which
    decide nothing: the next batch of the signature is checked again).
    """

    status: str
    detail: str = ""
    #: What the strategy raised (``"failed"`` only).
    error: Exception | None = field(default=None, compare=False, repr=False)


def check_strategy(
    strategy: JacobianStrategy,
    program: ResidualProgram,
    params: Params,
    inputs: Any,
    targets: Any,
    reference: Reference,
) -> ProbeVerdict:
    """Run ``strategy`` on the probe and compare it with the whole-batch ``reference``.

    The residuals must match the batch evaluation and ``Jᵀw`` must match
    ``Σᵢ wᵢ ∂rᵢ/∂θ``, both to ``√ε`` of their scale: a per-sample strategy on samples
    that interact (a residual minus the batch mean, a module computing
    ``x - x.mean(0)``, ``F.batch_norm(training=True)``) misses the cross-sample terms
    and fails.  Costs the strategy on the probe and one host synchronisation.
    """
    try:
        jac, r = strategy(program, params, inputs, targets)
    except CouplingError as exc:  # the outer-product rule's own check saw the interaction
        return ProbeVerdict("coupled", exc.detail)
    except Exception as exc:  # any failure means "not this strategy"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProbeVerdict("failed", f"{type(exc).__name__}: {first[:300]}", exc)
    ref = reference
    if r.shape != ref.residuals.shape:
        return ProbeVerdict(
            "coupled",
            f"{r.numel()} residuals sample by sample against {ref.residuals.numel()} "
            "for the whole probe",
        )
    w = ref.weights.to(jac.dtype)
    jw = jac.T @ w
    finite = (
        torch.isfinite(r).all()
        & torch.isfinite(ref.residuals).all()
        & torch.isfinite(jw).all()
        & torch.isfinite(ref.weighted_grad).all()
    )
    same_r = _close(r, ref.residuals, ref.residuals.abs().max())
    scale = torch.maximum((jac.abs().T @ w.abs()).max(), ref.weighted_grad.abs().max())
    same_j = _close(jw, ref.weighted_grad.to(jw.dtype), scale)
    finite_h, same_r_h, same_j_h = torch.stack([finite, same_r, same_j]).tolist()
    if not finite_h:
        return ProbeVerdict("undecided")
    if not same_r_h:
        return ProbeVerdict("coupled", "the residuals differ from the whole batch's")
    if not same_j_h:
        return ProbeVerdict("coupled", "the Jacobian's rows differ from the whole batch's")
    return ProbeVerdict("ok")


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
