"""The outer-product rule: a Linear or Conv layer's rows of J, ``∂rᵢ/∂W = gᵢ aᵢᵀ``.

Written straight into J from one batched forward pass and one backward pass per
residual of a sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from .. import conv_rows
from ..layers import TrainableLayer, trainable_layers
from . import factors as factor_stats
from .factors import _Factors
from .probes import _refuse_coupling
from .program import Params, ResidualProgram, _leading, _signature, _UnsupportedError
from .recording import _Call, _layer_outputs, _record_calls


def outer_product_layers(
    model: nn.Module, names: Sequence[str], params: Sequence[Tensor]
) -> tuple[TrainableLayer, ...] | None:
    """The layers holding the trainable ``params``, if each is a Linear, Conv1d or Conv2d.

    Returns ``None`` when a trainable parameter lives in any other module (a
    normalisation, a 3-D convolution, a custom module, a subclass that may change its
    forward): the per-sample reverse strategy then uses ``vmap``.
    """
    layers: list[TrainableLayer] = []
    covered: set[str] = set()
    for layer in trainable_layers(model, names, params):
        if type(layer.module) is not nn.Linear and not conv_rows.is_conv(layer.module):
            return None
        layers.append(layer)
        covered.update(n for n in (layer.weight, layer.bias) if n is not None)
    if covered != set(names):
        return None
    return tuple(layers)


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
            assert isinstance(layer.module, nn.Linear)
            fan_out, fan_in = layer.module.weight.shape
            g3 = g.detach().reshape(batch, -1, fan_out)
            a3 = a.detach().reshape(batch, -1, fan_in)
            single = g3.shape[1] == 1
            wide = fan_out * fan_in >= factor_stats.FACTOR_GAIN * (fan_out + fan_in)
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
    layer: TrainableLayer,
    a: Tensor,
    g: Tensor,
    starts: dict[str, int],
    j: int,
    written: set[tuple[int, str]],
) -> None:
    """Write a convolution's rows for residual j (im2col patches times ``g``)."""
    module = layer.module
    assert isinstance(module, (nn.Conv1d, nn.Conv2d))
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
