"""The LM scenarios that the distributed tests share: models, data, shards and options.

Every rank trains the same model on its shard of one global batch (shards of unequal
size, in rank order); the single-process reference trains on the concatenated batch.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

import secondorder as so

STEPS = 6
HIDDEN = 5  # n = 3 * 5 + 1 = 16 parameters
N_PRIMAL = 61  # m > n, and shards of unequal size for 2 and 4 ranks
N_DUAL = 11  # m < n
#: name -> (options, global batch size)
SCENARIOS: dict[str, tuple[dict[str, Any], int]] = {
    "primal-cholesky": ({"form": "primal", "solver": "cholesky"}, N_PRIMAL),
    "primal-eigh-geodesic": ({"form": "primal", "solver": "eigh", "geodesic": True}, N_PRIMAL),
    "primal-cg": ({"solver": "cg", "cg_rtol": 1e-12}, N_PRIMAL),
    "primal-cg-geodesic": ({"solver": "cg", "cg_rtol": 1e-12, "geodesic": True}, N_PRIMAL),
    "primal-qr": ({"form": "primal", "solver": "qr"}, N_PRIMAL),
    "dual-cholesky": ({"form": "dual", "solver": "cholesky"}, N_DUAL),
    "dual-eigh-geodesic": ({"form": "dual", "solver": "eigh", "geodesic": True}, N_DUAL),
    "auto": ({}, N_PRIMAL),
    # float32 models under gram_dtype="auto": float32 normal matrices at this λ, the
    # dual form's precision measure computed from the gathered rows.
    "primal-auto-float32": ({"dtype": torch.float32, "damping": 1.0}, N_PRIMAL),
    "dual-auto-float32": ({"dtype": torch.float32, "damping": 1.0, "form": "dual"}, N_DUAL),
}
#: Four processes share this machine's cores, and each collective waits for all of
#: them to be scheduled: on 4 ranks, one scenario per form.
SCENARIOS_4 = ("primal-cholesky", "primal-cg", "dual-cholesky")
CASES = [(2, name) for name in SCENARIOS] + [(4, name) for name in SCENARIOS_4]
CASE_IDS = [f"{world}ranks-{name}" for world, name in CASES]
#: The single-process run and the distributed run sum in different orders, so they
#: agree to rounding, amplified by the conditioning of the normal equations over a few
#: steps.  On one process, changing only the slice size (so only the order of the
#: sums) moves the parameters of these runs by at most 3e-12 relative after 6 steps.
RTOL = 1e-9
#: float32 runs: the same differences of summation order, in float32 rounding.
RTOL_FLOAT32 = 1e-4


def model_for(seed: int, hidden: int = HIDDEN, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def options_of(name: str) -> tuple[dict[str, Any], torch.dtype, int]:
    """The optimizer options, the model dtype and the global batch size of a scenario."""
    options, n = SCENARIOS[name]
    options = dict(options)
    dtype = options.pop("dtype", torch.float64)
    return options, dtype, n


def global_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 2 - 1
    return x, torch.sin(2 * x)


def shard(n: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(n)
    return torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def info_dict(info: so.StepInfo) -> dict[str, Any]:
    d = asdict(info)
    del d["timings"]
    return d


def train(opt: so.LevenbergMarquardt, model: nn.Module, x: Any, y: Any) -> dict[str, Any]:
    params, infos = [], []
    for _ in range(STEPS):
        infos.append(info_dict(opt.step(x, y)))
        params.append(flat(model))
    return {"params": params, "infos": infos}
