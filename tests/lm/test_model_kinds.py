"""Model kinds that per-sample ``vmap`` cannot run, and hooks that torch.compile sees.

Under the default ``jacobian="auto"`` a GRU/RNN/LSTM, an ``Embedding(max_norm=...)``
and an ``Embedding(sparse=True)`` get a strategy that works, and the normal equations
it builds equal those of :func:`torch.func.jacrev` of the whole residual vector.  A
forced per-sample strategy that cannot run them is refused before anything changes,
with a message naming the module and the strategies that work.  Dropout in training
mode is refused with a message that says what to do.  No global
module hook is registered during a step (``torch.compile`` warns about those).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev
from unchanged import assert_unchanged, state_of

import secondorder as so

DT = torch.float64
# vmap's fallback for ops without a batching rule warns; the probe tries those first.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(2, 3, batch_first=True)
        self.out = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.rnn(x)
        out: Tensor = self.out(h[:, -1])
        return out


class Bag(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, **options)  # type: ignore[arg-type]
        self.out = nn.Linear(3, 1)

    def forward(self, i: Tensor) -> Tensor:
        out: Tensor = self.out(self.emb(i).mean(1))
        return out


def sequences() -> Tensor:
    return torch.randn(12, 5, 2, generator=torch.Generator().manual_seed(0), dtype=DT)


def indices() -> Tensor:
    return torch.randint(0, 10, (12, 4), generator=torch.Generator().manual_seed(0))


KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "gru": (lambda: Recurrent(nn.GRU), sequences),
    "rnn": (lambda: Recurrent(nn.RNN), sequences),
    "lstm": (lambda: Recurrent(nn.LSTM), sequences),
    # A max_norm no row reaches: the renormalisation runs (and breaks vmap) but
    # changes nothing, so jacrev of the plain lookup is the reference.
    "embedding-max-norm": (lambda: Bag(max_norm=100.0), indices),
    "embedding-sparse": (lambda: Bag(sparse=True), indices),
}


def reference(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """J and r of ``model(x) - y`` by jacrev (sparse embeddings on a dense copy)."""
    dense = copy.deepcopy(model)
    for m in dense.modules():
        if isinstance(m, nn.Embedding):
            m.sparse = False
    params = {k: p.detach() for k, p in dense.named_parameters()}

    def r(p: dict[str, Tensor]) -> Tensor:
        return (functional_call(dense, p, (x,)) - y).reshape(-1)

    jac = jacrev(r)(params)
    return torch.cat([jac[k].reshape(-1, params[k].numel()) for k in params], 1), r(params)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_auto_finds_a_strategy_that_matches_jacrev(kind: str) -> None:
    make, inputs = KINDS[kind]
    torch.manual_seed(0)
    model = make().to(DT)
    x = inputs()
    y = torch.randn(12, 1, generator=torch.Generator().manual_seed(1), dtype=DT)
    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    opt.plan(x, y)
    problem = opt.internals().problem
    assert problem is not None
    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    system = problem.linearize(x0)
    J, r = reference(model, x, y)
    torch.testing.assert_close(system.grad, J.T @ r)
    gram = system.gram if system.gram is not None else system.jac.T @ system.jac
    torch.testing.assert_close(gram, J.T @ J)
    info = opt.step(x, y)
    assert info.loss < info.loss_before


CAUSES = {
    "gru": r"'rnn' \(GRU\)",
    "rnn": r"'rnn' \(RNN\)",
    "lstm": r"'rnn' \(LSTM\)",
    "embedding-max-norm": r"'emb' \(Embedding\(max_norm=100\.0\)\)",
    "embedding-sparse": r"'emb' \(Embedding\(sparse=True\)\)",
}
#: Forward mode never forms an embedding's sparse gradient: vmap runs it (see below).
CANNOT = [(k, "reverse") for k in sorted(KINDS)] + [
    (k, "forward") for k in sorted(KINDS) if k != "embedding-sparse"
]


@pytest.mark.parametrize(("kind", "jacobian"), CANNOT)
def test_forced_per_sample_strategy_vmap_cannot_run_is_refused(kind: str, jacobian: str) -> None:
    make, inputs = KINDS[kind]
    torch.manual_seed(0)
    model = make().to(DT)
    x = inputs()
    y = torch.randn(12, 1, generator=torch.Generator().manual_seed(1), dtype=DT)
    opt = so.LevenbergMarquardt(model, so.residuals.mse, jacobian=jacobian)
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    whole = "batch_forward" if jacobian == "forward" else "batch_reverse"
    with pytest.raises(
        ValueError,
        match=rf"jacobian='{jacobian}' cannot compute this model's per-sample Jacobian: "
        rf"torch\.func\.vmap cannot run its module\(s\) {CAUSES[kind]} sample by sample.*"
        rf"Use jacobian='{whole}'.*'auto'.*Nothing was changed",
    ):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)


def test_forced_forward_mode_runs_a_sparse_embedding_as_asked() -> None:
    # A guard against refusing too much: forward mode runs Embedding(sparse=True)
    # sample by sample, so the forced strategy is checked, kept and right.
    make, inputs = KINDS["embedding-sparse"]
    torch.manual_seed(0)
    model = make().to(DT)
    x = inputs()
    y = torch.randn(12, 1, generator=torch.Generator().manual_seed(1), dtype=DT)
    opt = so.LevenbergMarquardt(model, so.residuals.mse, jacobian="forward")
    opt.plan(x, y)
    problem = opt.internals().problem
    assert problem is not None
    system = problem.linearize(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    J, r = reference(model, x, y)
    torch.testing.assert_close(system.grad, J.T @ r)
    gram = system.gram if system.gram is not None else system.jac.T @ system.jac
    torch.testing.assert_close(gram, J.T @ J)
    info = opt.step(x, y)
    assert info.jacobian == "forward" and info.loss < info.loss_before


@pytest.mark.parametrize("jacobian", ["reverse", "forward"])
def test_forced_per_sample_strategy_refuses_dropout_in_training_mode(jacobian: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    x = torch.randn(16, 3, dtype=DT)
    opt = so.LevenbergMarquardt(model, jacobian=jacobian)
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    with pytest.raises(
        ValueError,
        match=rf"jacobian='{jacobian}': the residuals differ between two evaluations.*"
        r"Dropout in training mode: \['1'\].*model\.eval\(\)",
    ):
        opt.step(x, x.sum(1, keepdim=True))
    assert_unchanged(model, before, opt, state)


def test_dropout_in_training_mode_is_refused_with_advice() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    x = torch.randn(16, 3, dtype=DT)
    y = x.sum(1, keepdim=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = so.LevenbergMarquardt(model)
    with pytest.raises(
        ValueError,
        match=r"differ between two evaluations.*Dropout in training mode: \['1'\].*model\.eval\(\)"
        r".*jacobian='batch_reverse'",
    ):
        opt.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.eval()
    info = opt.step(x, y)
    assert info.jacobian == "reverse" and info.accepted


class SeesGlobalHooks(nn.Module):
    """Identity that records how many global module hooks exist during each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        mod = nn.modules.module
        self.seen.append(
            len(mod._global_forward_pre_hooks)
            + len(mod._global_forward_hooks)
            + len(mod._global_backward_hooks)
            + len(mod._global_backward_pre_hooks)
        )
        return x


@pytest.mark.parametrize("jacobian", ["auto", "reverse"])
def test_no_global_module_hook_during_a_step(jacobian: str) -> None:
    # nn.Linear layers and an eval-mode Dropout: the outer-product rule runs and
    # watches the dropout module, which used to need a global forward pre-hook.
    torch.manual_seed(0)
    spy = SeesGlobalHooks()
    model = nn.Sequential(nn.Linear(3, 6), spy, nn.Dropout(0.2), nn.Tanh(), nn.Linear(6, 1))
    model = model.to(DT)
    model[2].eval()
    x = torch.randn(16, 3, dtype=DT)
    info = so.LevenbergMarquardt(model, jacobian=jacobian).step(x, torch.sin(x[:, :1]))
    assert info.jacobian == "reverse"
    assert spy.seen and set(spy.seen) == {0}


def test_a_compiled_model_steps_without_a_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(16, 3, dtype=DT)
    y = torch.sin(x.sum(1, keepdim=True))
    opt = so.LevenbergMarquardt(compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = opt.step(x, y)
    assert info.accepted
