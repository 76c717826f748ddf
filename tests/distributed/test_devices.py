"""Several devices in one process, compared with one device.

``devices=["cpu", "cpu"]`` (and three entries) runs the whole multi-device path on
this machine: a deep-copied replica per entry, round-robin dispatch of the slices,
partial sums brought to the solver device.  The reference is the same optimizer
with ``devices=None`` on the same batch, float64, from the same weights.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict
from typing import Any

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.distributed.devices import DeviceGroup, resolve_devices

STEPS = 5
HIDDEN = 5  # n = 3 * 5 + 1 = 16 parameters
N_PRIMAL = 61  # m > n; slices of 8 leave a last slice of 5
N_DUAL = 11  # m < n; slices of 3 leave a last slice of 2
#: name -> (options, batch size, slice size)
SCENARIOS: dict[str, tuple[dict[str, Any], int, int]] = {
    "primal-cholesky": ({"form": "primal", "solver": "cholesky"}, N_PRIMAL, 8),
    "primal-cholesky-geodesic": (
        {"form": "primal", "solver": "cholesky", "geodesic": True},
        N_PRIMAL,
        8,
    ),
    "primal-qr": ({"form": "primal", "solver": "qr"}, N_PRIMAL, 8),
    "primal-cg": ({"solver": "cg", "cg_rtol": 1e-12}, N_PRIMAL, 8),
    "primal-cg-geodesic": ({"solver": "cg", "cg_rtol": 1e-12, "geodesic": True}, N_PRIMAL, 8),
    "dual-cholesky": ({"form": "dual", "solver": "cholesky"}, N_DUAL, 3),
    "dual-eigh-geodesic": ({"form": "dual", "solver": "eigh", "geodesic": True}, N_DUAL, 3),
}
#: In the primal form each device sums the Grams of its own slices and the solver
#: device adds the per-device sums, so the Gram's additions happen in another order
#: than on one device; everything else (the loss, Jᵀr, diag(JᵀJ) and, in the other
#: forms, J itself) is added in slice order and has the same bits.  Measured on these
#: runs: 2 or 3 devices move the parameters by at most 1.1e-11 (‖Δ‖/‖p‖) after 5
#: steps; on one device, changing only the slice size (so only the order of the
#: Gram's sums) moves them by up to 2.6e-12
#: (test_gram_order_alone_moves_parameters_by_rounding).  Both are the Gram's
#: rounding amplified by its conditioning over a few steps.  Step records (ρ, λ, the
#: losses) are ratios of such quantities and get a looser bound.
PARAM_RTOL = 1e-10
INFO_RTOL = 1e-9
BITWISE = {"primal-qr", "primal-cg", "primal-cg-geodesic", "dual-cholesky", "dual-eigh-geodesic"}


def model_for(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)).double()


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 2 - 1
    return x, torch.sin(2 * x)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def rel_diff(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(p - q) / torch.linalg.vector_norm(q))


def info_dict(info: so.StepInfo) -> dict[str, Any]:
    d = asdict(info)
    del d["timings"]
    return d


def train(devices: list[Any] | None, name: str, steps: int = STEPS) -> dict[str, Any]:
    options, n, slice_size = SCENARIOS[name]
    model = model_for()
    opt = so.LevenbergMarquardt(model, devices=devices, slice_size=slice_size, **options)
    x, y = batch(n)
    params, infos = [], []
    for _ in range(steps):
        infos.append(info_dict(opt.step(x, y)))
        params.append(flat(model))
    return {"params": params, "infos": infos, "model": model, "opt": opt}


def assert_same_infos(a: dict[str, Any], b: dict[str, Any], rtol: float) -> None:
    for key, va in a.items():
        vb = b[key]
        if isinstance(va, float) and rtol > 0:
            assert va == pytest.approx(vb, rel=rtol, abs=1e-300), key
        elif key == "reason" and rtol > 0:
            # The reason quotes ρ and λ to 3 digits; compare its words.
            assert va.split(" ")[0] == vb.split(" ")[0]
        else:
            assert va == vb or (isinstance(va, float) and math.isnan(va) and math.isnan(vb)), key


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("count", [2, 3])
def test_several_devices_equal_one_device(name: str, count: int) -> None:
    ref = train(None, name)
    got = train(["cpu"] * count, name)
    assert any(i["accepted"] for i in ref["infos"])
    bitwise = name in BITWISE
    for step, (p, q, a, b) in enumerate(
        zip(got["params"], ref["params"], got["infos"], ref["infos"], strict=True)
    ):
        if bitwise:
            assert torch.equal(p, q), f"step {step}"
            assert a == b, f"step {step}"
        else:
            assert rel_diff(p, q) <= PARAM_RTOL, f"step {step}"
            assert_same_infos(a, b, INFO_RTOL)


def test_gram_order_alone_moves_parameters_by_rounding() -> None:
    """The tolerance of the primal runs: reordering the Gram's sums on one device."""
    options, n, _ = SCENARIOS["primal-cholesky-geodesic"]
    x, y = batch(n)
    runs = []
    for slice_size in (8, 5):
        model = model_for()
        opt = so.LevenbergMarquardt(model, slice_size=slice_size, **options)
        for _ in range(STEPS):
            opt.step(x, y)
        runs.append(flat(model))
    assert 0 < rel_diff(runs[0], runs[1]) <= PARAM_RTOL / 10


@pytest.mark.parametrize("name", ["primal-cholesky-geodesic", "dual-cholesky"])
def test_replicas_stay_identical_to_the_model(name: str) -> None:
    got = train(["cpu", "cpu", "cpu"], name, steps=3)
    model, opt = got["model"], got["opt"]
    assert opt.devices == (torch.device("cpu"),) * 3
    assert opt.solver_device == torch.device("cpu")
    replicas = opt.replicas
    assert replicas[0] is model
    assert all(r is not model for r in replicas[1:])
    assert len({id(r) for r in replicas}) == 3
    state = model.state_dict()
    for r in replicas[1:]:
        other = r.state_dict()
        assert list(other) == list(state)
        assert all(torch.equal(other[k], state[k]) for k in state)
        # Separate storage: a replica is a copy, not a view of the model.
        assert all(
            a.data_ptr() != b.data_ptr()
            for a, b in zip(model.parameters(), r.parameters(), strict=True)
        )


def test_every_device_computes_its_slices() -> None:
    """Slice i runs on replica i mod D: count the forward calls of each replica."""
    model = model_for()
    opt = so.LevenbergMarquardt(
        model, devices=["cpu", "cpu", "cpu"], slice_size=8, form="primal", solver="cholesky"
    )
    calls = [0, 0, 0]
    for i, r in enumerate(opt.replicas):

        def hook(*_: Any, i: int = i) -> None:
            calls[i] += 1

        r.register_forward_hook(hook)
    x, y = batch(N_PRIMAL)  # 8 slices: entries 0, 1, 2 get 3, 3, 2
    opt.step(x, y)
    assert calls[1] > 0 and calls[2] > 0
    per_slice = calls[2] // 2
    assert calls[1] == 3 * per_slice
    # The model itself also ran the validation probe.
    assert calls[0] >= 3 * per_slice


def test_without_a_slice_size_every_device_gets_a_slice() -> None:
    model = model_for()
    opt = so.LevenbergMarquardt(model, devices=["cpu", "cpu", "cpu"], form="primal")
    calls = [0, 0, 0]
    for i, r in enumerate(opt.replicas):

        def hook(*_: Any, i: int = i) -> None:
            calls[i] += 1

        r.register_forward_hook(hook)
    x, y = batch(N_PRIMAL)  # slices of ceil(61 / 3) = 21 samples: 21, 21, 19
    opt.step(x, y)
    assert calls[1] == calls[2] > 0


class Tied(nn.Module):
    """Two layers sharing one weight, and a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.c = nn.Linear(3, 1)
        self.c.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_tied_and_frozen_parameters_replicate() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.randn(20, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = Tied().double()
    twin = copy.deepcopy(model)
    opt = so.LevenbergMarquardt(model, devices=["cpu"] * 3, slice_size=6, solver="qr")
    ref = so.LevenbergMarquardt(twin, slice_size=6, solver="qr")
    for _ in range(3):
        assert info_dict(opt.step(x, y)) == info_dict(ref.step(x, y))
    assert torch.equal(flat(model), flat(twin))
    for r in opt.replicas[1:]:
        assert r.b.weight is r.a.weight
        assert torch.equal(flat(r), flat(model))


def test_rejected_steps_leave_model_and_replicas_unchanged() -> None:
    model = model_for()
    x, y = batch(N_PRIMAL)
    # No step of a nonlinear model reaches a gain ratio of 0.999999 with λ this large.
    opt = so.LevenbergMarquardt(
        model,
        devices=["cpu", "cpu"],
        slice_size=8,
        damping=1e3,
        max_attempts=2,
        min_gain_ratio=0.999999,
    )
    before = copy.deepcopy(model.state_dict())
    info = opt.step(x, y)
    assert not info.accepted
    assert info.attempts == 2
    for r in opt.replicas:
        after = r.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)


def batchnorm_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()


def test_batchnorm_buffers_and_modes_follow_the_model() -> None:
    """Train mode (batch statistics, whole batch) then eval mode (running stats, sliced)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    results = []
    for devices in (None, ["cpu", "cpu"]):
        model = batchnorm_model()
        # QR works on J itself, so the runs may be compared bit for bit.
        opt = so.LevenbergMarquardt(model, devices=devices, slice_size=7, solver="qr")
        for _ in range(2):
            assert opt.step(x, y).accepted
        model.eval()
        for _ in range(2):
            opt.step(x, y)
        results.append((model, opt))
    (ref, _), (model, opt) = results
    assert ref.training is False
    for k, v in ref.state_dict().items():
        # Running statistics and num_batches_tracked as well as the weights.
        assert torch.equal(model.state_dict()[k], v), k
    replica = opt.replicas[1]
    assert not replica.training and not replica[1].training
    for k, v in model.state_dict().items():
        assert torch.equal(replica.state_dict()[k], v), k


def test_state_dict_round_trip_steps_in_lockstep() -> None:
    x, y = batch(N_PRIMAL)
    model = model_for()
    options = {"slice_size": 8, "damping_matrix": "more", "form": "primal"}
    opt = so.LevenbergMarquardt(model, devices=["cpu", "cpu"], **options)
    for _ in range(2):
        opt.step(x, y)
    twin = copy.deepcopy(model)
    opt2 = so.LevenbergMarquardt(twin, devices=["cpu", "cpu"], **options)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.damping == opt.damping
    for _ in range(3):
        assert info_dict(opt.step(x, y)) == info_dict(opt2.step(x, y))
        assert torch.equal(flat(model), flat(twin))


def test_devices_are_normalised_and_solver_device_defaults_to_the_first() -> None:
    opt = so.LevenbergMarquardt(model_for(), devices=("cpu:0", torch.device("cpu")))
    assert opt.devices == (torch.device("cpu"), torch.device("cpu"))
    assert opt.solver_device == torch.device("cpu")
    opt = so.LevenbergMarquardt(model_for(), devices=["cpu"], solver_device="cpu")
    assert opt.solver_device == torch.device("cpu")
    assert opt.replicas == (opt.model,)
    # Without devices, the model's own device computes.
    plain = so.LevenbergMarquardt(model_for())
    assert plain.devices == (torch.device("cpu"),)
    assert plain.replicas == (plain.model,)


def test_the_device_group_moves_and_sums_on_the_solver_device() -> None:
    group = resolve_devices(["cpu", "cpu", "cpu"], None, torch.device("cpu"))
    assert isinstance(group, DeviceGroup)
    assert [group.owner(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    slices = [(torch.full((2,), float(i)), {"t": torch.tensor([i])}) for i in range(5)]
    staged = list(group.stage(slices))
    assert [k for k, _, _ in staged] == [0, 1, 2, 0, 1]
    assert all(torch.equal(a, s[0]) for (_, a, _), s in zip(staged, slices, strict=True))
    assert [int(t["t"]) for _, _, t in staged] == list(range(5))
    parts = [torch.ones(3), None, 2 * torch.ones(3)]
    assert torch.equal(group.sum(parts), torch.full((3,), 3.0))
    assert group.sum([None, None]) is None
    x = torch.arange(3.0)
    copies = group.replicate(x)
    assert len(copies) == 3 and all(c is x for c in copies)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": "cpu"}, TypeError, r"devices must be a list of devices .* got str: 'cpu'"),
        ({"devices": []}, ValueError, r"Invalid devices=\[\]: give at least one device"),
        ({"devices": ["cpu", "gpu"]}, ValueError, r"Invalid devices\[1\]='gpu'"),
        (
            {"devices": ["cpu", 1.5]},
            TypeError,
            r"devices\[1\] must be a torch.device, .* got float: 1.5",
        ),
        ({"devices": ["meta"]}, ValueError, r"Invalid devices\[0\]='meta': a meta device"),
        (
            {"devices": ["cpu"], "solver_device": "nope"},
            ValueError,
            r"Invalid solver_device='nope'",
        ),
        ({"solver_device": [0]}, TypeError, r"solver_device must be a torch.device, .* got list"),
    ],
)
def test_bad_devices_are_refused_before_anything_changes(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = model_for()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        so.LevenbergMarquardt(model, **kwargs)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_cuda_device_this_process_lacks_is_refused() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = "CUDA is not available" if count == 0 else f"this process sees {count} CUDA device"
    with pytest.raises(ValueError, match=rf"Invalid devices\[1\]='cuda:{count}': {why}"):
        so.LevenbergMarquardt(model_for(), devices=["cpu", f"cuda:{count}"])


# -- devices within each rank of a process group ------------------------------------------

DIST_SCENARIOS = ("primal-cholesky", "primal-cg", "dual-cholesky")


def _rank_job(rank: int, world: int, init: str, out: str) -> None:
    import pickle
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        result: dict[str, Any] = {}
        for name in DIST_SCENARIOS:
            options, n, slice_size = SCENARIOS[name]
            x, y = (torch.tensor_split(t, world)[rank] for t in batch(n))
            model = model_for()
            opt = so.LevenbergMarquardt(
                model, devices=["cpu", "cpu"], slice_size=slice_size, **options
            )
            params = []
            for _ in range(STEPS):
                opt.step(x, y)
                params.append(flat(model))
            result[name] = {"params": params, "replica": flat(opt.replicas[1])}
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps({"result": result}))
    except BaseException as exc:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps({"raised": repr(exc)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starting two Python processes with torch takes most of 20 s here
@pytest.mark.distributed
def test_devices_within_each_rank_equal_one_process(tmp_path: Any) -> None:
    """Two gloo ranks, two devices each, against one process on the whole batch."""
    import multiprocessing as mp
    import pickle

    world = 2
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_rank_job, args=(r, world, init, str(tmp_path))) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for r, res in enumerate(results):
        assert "result" in res, f"rank {r} raised {res.get('raised')}"
    for name in DIST_SCENARIOS:
        ref = train(None, name)
        ranks = [res["result"][name] for res in results]
        for step in range(STEPS):
            # Every rank applies rank 0's step: the same bits everywhere.
            assert torch.equal(ranks[0]["params"][step], ranks[1]["params"][step])
            # Ranks and devices sum in another order than one process: test_distributed's
            # tolerance for the same model.
            assert rel_diff(ranks[0]["params"][step], ref["params"][step]) <= 1e-9, name
        assert all(torch.equal(rk["replica"], rk["params"][-1]) for rk in ranks)
