"""A checkpoint whose values would break a later step is refused, and the refusal
changes nothing; a sound one saved on another device loads onto the layers' device.

Each bad entry is a good state_dict with one value damaged; after the refusal the
K-FAC state is compared bitwise with the state before, and a good load still resumes
bitwise (the reference: the run that was never interrupted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC
from tests.kfac.faults import Fault, same, state_of

DT = torch.float64
NAN, INF = float("nan"), float("inf")


def make(method: str = "eigen", **kw: Any) -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    kw.setdefault("inv_dtype", DT)
    return net, KFAC(net, compute_method=method, damping=0.1, **kw)


def train(net: nn.Module, k: KFAC, batches: range) -> None:
    for i in batches:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)
        net.zero_grad()
        (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()
        k.step()


def damaged(state: dict[str, Any], layer: str, where: str, key: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``state`` with ``layers[layer][where][key]`` (or ``[key]``) changed."""
    out = {**state, "layers": {n: dict(e) for n, e in state["layers"].items()}}
    entry = out["layers"][layer]
    entry["inv"] = {k: v.clone() for k, v in entry["inv"].items()}
    target = entry["inv"] if where == "inv" else entry
    if callable(value):
        target[key] = value(target[key].clone())
    elif value is None:
        del target[key]
    else:
        target[key] = value
    return out


def at(index: tuple[int, ...], v: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def put(t: torch.Tensor) -> torch.Tensor:
        t[index] = v
        return t

    return put


def off_diagonal(
    i: int, j: int, scale: float, mirror: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """F[i, j] (and F[j, i] with ``mirror``) set to ``scale·√(F_ii·F_jj)``."""

    def put(t: torch.Tensor) -> torch.Tensor:
        v = scale * float((t[0, i, i] * t[0, j, j]).sqrt())
        t[0, i, j] = v
        if mirror:
            t[0, j, i] = v
        return t

    return put


#: (compute_method, inv_update_steps, layer, "factor"/"inv", key, new value, match)
BAD: list[tuple[str, int, str, str, str, Any, str]] = [
    ("eigen", 1, "0", "factor", "A", at((0, 1, 2), NAN), r"layer '0' factor A has 1 non-finite"),
    ("eigen", 1, "2", "factor", "G", at((0, 0, 0), INF), r"layer '2' factor G has 1 non-finite"),
    (
        "eigen",
        1,
        "0",
        "factor",
        "A",
        at((0, 3, 3), -0.5),
        r"layer '0' factor A has a diagonal value -0.5, but it must be >= 0",
    ),
    (
        "eigen",
        10,
        "0",
        "inv",
        "dA",
        at((0, 0), INF),
        r"layer '0' decomposition dA has 1 non-finite",
    ),
    (
        "eigen",
        10,
        "0",
        "inv",
        "dG",
        at((0, 1), -1e-3),
        r"layer '0' decomposition dG has a diagonal value -0.001, but it must be >= 0",
    ),
    (
        "eigen",
        10,
        "2",
        "inv",
        "QA",
        at((0, 1, 0), NAN),
        r"layer '2' decomposition QA has 1 non-finite",
    ),
    (
        "eigen",
        10,
        "0",
        "inv",
        "QA",
        None,
        r"layer '0' holds decomposition \['QG', 'dA', 'dG'\], which compute_method='eigen'",
    ),
    (
        "inverse",
        10,
        "2",
        "inv",
        "G_inv",
        at((0, 2, 2), 0.0),
        r"layer '2' decomposition G_inv has a diagonal value 0.0, but it must be > 0",
    ),
    (
        "inverse",
        10,
        "0",
        "inv",
        "A_inv",
        at((0, 0, 1), NAN),
        r"layer '0' decomposition A_inv has 1 non-finite",
    ),
    (
        # an indefinite factor: eigh would clamp its negative eigenvalue, silently
        "eigen",
        1,
        "0",
        "factor",
        "A",
        off_diagonal(0, 2, 5.0, mirror=True),
        r"layer '0' factor A is not a covariance: F\[0, 2\] = ",
    ),
    (
        "inverse",
        10,
        "2",
        "factor",
        "G",
        off_diagonal(2, 1, 1.5, mirror=True),
        r"layer '2' factor G is not a covariance: F\[1, 2\] = ",
    ),
    (
        # eigh reads one triangle: an asymmetric factor would lose the other, silently
        "eigen",
        1,
        "2",
        "factor",
        "A",
        off_diagonal(1, 3, 0.5, mirror=False),
        r"layer '2' factor A is not symmetric: F\[1, 3\] = ",
    ),
    (
        "eigen",
        1,
        "0",
        "factor",
        "A",
        lambda t: t.to("meta"),
        r"layer '0' factor A is on the meta device, which holds no values",
    ),
]


@pytest.mark.parametrize(("method", "every", "layer", "where", "key", "value", "match"), BAD)
def test_damaged_value_is_refused_and_changes_nothing(
    method: str, every: int, layer: str, where: str, key: str, value: Any, match: str
) -> None:
    source_net, source = make(method, inv_update_steps=every)
    train(source_net, source, range(3))
    net, k = make(method, inv_update_steps=every)
    train(net, k, range(1))
    before = state_of(k, net)
    bad = damaged(source.state_dict(), layer, where, key, value)
    with pytest.raises(ValueError, match=r"K-FAC state_dict: " + match):
        k.load_state_dict(bad)
    assert same(state_of(k, net), before)


@pytest.mark.parametrize("layer", ["0", "2"])
def test_missing_decomposition_at_a_step_that_uses_it_is_refused(layer: str) -> None:
    # inv_update_steps=10 and steps=3: the next 7 steps precondition with the saved
    # decomposition, so an emptied one (a rank's state lost in transit) cannot load
    source_net, source = make(inv_update_steps=10)
    train(source_net, source, range(3))
    net, k = make(inv_update_steps=10)
    before = state_of(k, net)
    bad = damaged(source.state_dict(), layer, "factor", "inv", {})
    with pytest.raises(
        ValueError,
        match=rf"layer '{layer}' has no decomposition, but this rank preconditions the layer "
        r"with it before the next inverse update recomputes it",
    ):
        k.load_state_dict(bad)
    assert same(state_of(k, net), before)
    # at a step that recomputes it, the same state loads and resumes
    source2_net, source2 = make(inv_update_steps=10)
    train(source2_net, source2, range(10))
    good = damaged(source2.state_dict(), layer, "factor", "inv", {})
    k.load_state_dict(good)
    assert k.steps == 10


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_recompute_rebuilds_missing_decompositions_from_the_loaded_factors(method: str) -> None:
    # kfac-pytorch's checkpoints hold factors only; recompute=True decomposes them
    source_net, source = make(method, inv_update_steps=10)
    train(source_net, source, range(3))
    state = source.state_dict()
    for name in ("0", "2"):
        state = damaged(state, name, "factor", "inv", {})
    _, k = make(method, inv_update_steps=10)
    k.load_state_dict(state, recompute=True)
    assert k.steps == 3
    for name, layer in k.layers.items():
        expected = source.layers[name].decomposition(method, 0.1, DT, 10)
        assert layer.inv.keys() == expected.keys()
        assert all(torch.equal(layer.inv[key], expected[key]) for key in expected)


def test_good_checkpoint_resumes_bitwise_and_loads_onto_the_layers_dtype() -> None:
    ref_net, ref = make(inv_update_steps=2)
    train(ref_net, ref, range(5))
    src_net, src = make(inv_update_steps=2)
    train(src_net, src, range(3))
    state = src.state_dict()
    net, k = make(inv_update_steps=2)
    net.load_state_dict(src_net.state_dict())
    k.load_state_dict(state)
    train(net, k, range(3, 5))
    assert same(state_of(k, net), state_of(ref, ref_net))


def test_decompositions_load_in_this_kfacs_inv_dtype() -> None:
    # float32 decompositions into a float64 K-FAC: cast, as torch.optim casts its state
    # to the parameters' dtype, so that every rank broadcasts the same dtype
    src_net, src = make(inv_update_steps=10, inv_dtype=torch.float32)
    train(src_net, src, range(1))
    assert all(v.dtype == torch.float32 for v in src.layers["0"].inv.values())
    _, k = make(inv_update_steps=10)
    k.load_state_dict(src.state_dict())
    assert all(v.dtype == DT for layer in k.layers.values() for v in layer.inv.values())
    torch.testing.assert_close(
        k.layers["0"].inv["dA"], src.layers["0"].inv["dA"].to(DT), rtol=0, atol=0
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_saved_on_cuda_loads_onto_the_cpu_and_back() -> None:
    # a raw "expected all tensors on the same device" at the next step before
    cuda_net, on_cuda = make(inv_update_steps=10)
    on_cuda.remove_hooks()
    cuda_net.to("cuda")
    cuda_k = KFAC(cuda_net, damping=0.1, inv_dtype=DT, inv_update_steps=10)
    train(cuda_net, cuda_k, range(3))
    state = cuda_k.state_dict()
    assert state["layers"]["0"]["A"].is_cuda
    net, k = make(inv_update_steps=10)
    k.load_state_dict(state)
    net2, k2 = make(inv_update_steps=10)
    k2.load_state_dict({**state, "layers": {n: _to_cpu(e) for n, e in state["layers"].items()}})
    for m in (net, net2):
        m.load_state_dict({n: v.cpu() for n, v in cuda_net.state_dict().items()})
    train(net, k, range(3, 5))
    train(net2, k2, range(3, 5))
    assert same(state_of(k, net), state_of(k2, net2))
    cuda_k.load_state_dict(k.state_dict())  # and from the CPU back onto the device
    assert cuda_k.layers["0"].inv["QA"].is_cuda


def _to_cpu(entry: dict[str, Any]) -> dict[str, Any]:
    out = {k: v.cpu() for k, v in entry.items() if k != "inv"}
    out["inv"] = {k: v.cpu() for k, v in entry["inv"].items()}
    return out


def test_indefinite_factor_with_a_sound_diagonal_is_refused() -> None:
    # [[1, 5], [5, 1]] has eigenvalues 6 and -4; its diagonal passes the >= 0 check
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2, bias=False)).to(DT)
    k = KFAC(net, damping=0.1, inv_dtype=DT)
    eye = torch.eye(2, dtype=DT)[None]
    state = {
        "steps": 1,
        "layers": {
            "0": {"A": torch.tensor([[[1.0, 5.0], [5.0, 1.0]]], dtype=DT), "G": eye, "inv": {}}
        },
    }
    before = state_of(k, net)
    with pytest.raises(
        ValueError,
        match=r"layer '0' factor A is not a covariance: F\[0, 1\] = 5\.0, F\[1, 0\] = 5\.0, "
        r"F\[0, 0\] = 1\.0, F\[1, 1\] = 1\.0 \(group 0\), but a factor is symmetric with "
        r"F\[i, j\]² <= F\[i, i\]·F\[j, j\]",
    ):
        k.load_state_dict(state, recompute=True)
    assert same(state_of(k, net), before)
    state["layers"]["0"]["A"] = torch.tensor([[[1.0, 0.5], [0.5, 1.0]]], dtype=DT)
    k.load_state_dict(state, recompute=True)  # a sound one loads
    assert torch.equal(k.layers["0"].A, state["layers"]["0"]["A"])


@pytest.mark.parametrize(
    ("method", "func", "at"),
    [("eigen", torch.linalg.eigh, 3), ("inverse", torch.linalg.cholesky_ex, 2)],
)
def test_load_interrupted_while_recomputing_changes_nothing(
    method: str, func: Any, at: int
) -> None:
    # before: the factors, step count and first layer's decomposition were assigned,
    # then the decompositions computed one layer at a time
    source_net, source = make(method, inv_update_steps=10)
    train(source_net, source, range(3))
    net, k = make(method, inv_update_steps=10)
    train(net, k, range(1))
    before = state_of(k, net)
    fault = Fault(func, KeyboardInterrupt("Ctrl-C while loading"), at=at)
    with fault, pytest.raises(KeyboardInterrupt, match="Ctrl-C while loading"):
        k.load_state_dict(source.state_dict(), recompute=True)
    assert fault.calls == at
    assert same(state_of(k, net), before)
    k.load_state_dict(source.state_dict(), recompute=True)
    assert k.steps == 3
    assert all(torch.equal(k.layers[n].G, source.layers[n].G) for n in k.layers)
