"""Work assignment (pure, no process group) and adaptive damping directions."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from secondorder.kfac import KFACOptimizer, LMDampingRule, assign_work
from secondorder.kfac.assignment import factor_cost


def brute_force_makespan(costs: list[float], world: int) -> float:
    best = float("inf")
    for combo in itertools.product(range(world), repeat=len(costs)):
        load = [0.0] * world
        for c, r in zip(costs, combo, strict=True):
            load[r] += c
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lpt_is_within_its_bound_of_the_optimum(world: int) -> None:
    # Graham's bound for longest-processing-time first: makespan <= (4/3 - 1/(3m)) OPT
    costs = {f"l{i}": float(c) for i, c in enumerate([27, 8, 64, 1, 125, 8, 27])}
    asg = assign_work(costs, world, 1)
    opt = brute_force_makespan(list(costs.values()), world)
    assert max(asg.loads(costs)) <= (4 / 3 - 1 / (3 * world)) * opt + 1e-9
    assert list(asg.inverse_worker) == list(costs)  # layer order kept
    assert asg.inverse_worker["l4"] == 0  # the largest goes first, to rank 0


def test_groups_for_the_three_strategies() -> None:
    costs = {"a": 8.0, "b": 4.0, "c": 2.0, "d": 1.0}
    comm = assign_work(costs, 4, 4)
    assert comm.worker_groups() == [[0, 1, 2, 3]] and comm.receiver_groups() == [[0], [1], [2], [3]]
    assert all(comm.is_grad_worker(n, r) for n in costs for r in range(4))
    mem = assign_work(costs, 4, 1)
    assert mem.worker_groups() == [[0], [1], [2], [3]] and mem.receiver_groups() == [[0, 1, 2, 3]]
    assert [r for r in range(4) if mem.is_grad_worker("a", r)] == [mem.inverse_worker["a"]]
    hyb = assign_work(costs, 4, 2)
    assert hyb.worker_groups() == [[0, 1], [2, 3]] and hyb.receiver_groups() == [[0, 2], [1, 3]]
    for n in costs:
        workers = [r for r in range(4) if hyb.is_grad_worker(n, r)]
        assert len(workers) == 2 and hyb.inverse_worker[n] in workers


def test_cost_models() -> None:
    assert factor_cost([3, 4], "compute") == 27 + 64
    assert factor_cost([3, 4], "memory") == 9 + 16


def test_lm_rule_directions() -> None:
    rule = LMDampingRule(interval=2, decay=0.5, min_damping=1e-3, max_damping=10.0)
    assert rule.update(1.0, 0.9) == pytest.approx(0.25)  # trusted model: λ shrinks
    assert rule.update(1.0, 0.5) == 1.0  # in between: unchanged
    assert rule.update(1.0, 0.1) == pytest.approx(4.0)  # poor model: λ grows
    assert rule.update(1.0, -3.0) == pytest.approx(4.0)  # loss went up: λ grows
    assert rule.update(8.0, -1.0) == 10.0 and rule.update(2e-3, 1.0) == 1e-3  # bounds
    assert rule.ratio(1.0, 0.5, -1.0) == pytest.approx(0.5)
    assert rule.ratio(1.0, float("nan"), -1.0) == float("-inf")
    assert rule.ratio(1.0, 0.5, 0.0) == float("-inf")


def adaptive_run(lr: float) -> KFACOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    opt = KFACOptimizer(
        model,
        lr=lr,
        momentum=0.0,
        kl_clip=None,
        damping=1.0,
        adaptive_damping=True,
        damping_adaptation_interval=1,
        inv_dtype=torch.float64,
    )

    def closure() -> torch.Tensor:
        return 0.5 * ((model(x) - y) ** 2).sum(1).mean()

    opt.zero_grad()
    closure().backward()
    opt.step(closure)
    return opt


def test_adaptive_damping_moves_lambda_the_documented_way() -> None:
    # a tiny step: the quadratic model is exact to first order, ρ ≈ 1, λ shrinks
    small = adaptive_run(1e-6)
    assert small.last_rho == pytest.approx(1.0, abs=1e-3)
    assert small.kfac.damping == pytest.approx(0.95)
    # a huge step overshoots: the loss rises, ρ < 0, λ grows
    big = adaptive_run(1e3)
    assert big.last_rho is not None and big.last_rho < 0
    assert big.kfac.damping == pytest.approx(1 / 0.95)


@pytest.mark.parametrize("at", [1, 2])
def test_a_closure_that_raises_leaves_parameters_sgd_and_kfac_as_they_were(at: int) -> None:
    # before: with the closure failing after the update (its second call), the
    # parameters, momentum and K-FAC's factors had moved and the error escaped
    import copy

    from tests.kfac.faults import same, state_of

    torch.manual_seed(0)
    dt = torch.float64
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(dt)
    opt = KFACOptimizer(model, lr=0.1, adaptive_damping=True, damping_adaptation_interval=1)
    x, y = torch.randn(16, 3, dtype=dt), torch.randn(16, 2, dtype=dt)

    def loss() -> torch.Tensor:
        return ((model(x) - y) ** 2).mean()

    for _ in range(2):
        opt.zero_grad()
        loss().backward()
        opt.step(loss)
    opt.zero_grad()
    loss().backward()
    before = {"kfac": state_of(opt.kfac, model), "sgd": copy.deepcopy(opt.state_dict())}
    calls = [0]

    def failing() -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt("Ctrl-C in the closure")
        return loss()

    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in the closure"):
        opt.step(failing)
    after = {"kfac": state_of(opt.kfac, model), "sgd": copy.deepcopy(opt.state_dict())}
    assert same(after, before)
    opt.step(loss)  # the retry goes through
    assert opt.kfac.steps == 3
