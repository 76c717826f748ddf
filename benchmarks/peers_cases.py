"""The reference runs shared by ``benchmarks.peers_reference_data`` and ``tests/compat``.

Each case is a reference's own example (kfac-pytorch's vision example, DistributedShampoo's
README examples) on a tiny float64 model and sklearn's digits.  A case is written against
a *module*: ``kfac`` (kfac-pytorch) or ``secondorder.compat.kfac`` for K-FAC,
``distributed_shampoo`` or ``secondorder.compat.distributed_shampoo`` for Shampoo, so the
generator and the tests run the same lines with only that import changed.

What was changed from the examples, and why: models and data are tiny (digits, float64);
Shampoo's ``precondition_frequency`` is 2 (the README's 100 would not precondition within
the few steps) and, where named, ``max_preconditioner_dim`` is 32 so that weights are cut
into 2-D blocks; the preconditioner configs ask for float64 factors (the reference
defaults to float32); learning rates and epsilon: see :data:`LR_SGD` and :data:`EPS`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BATCH = 64
#: The README's learning rates (0.01 and 0.001) rounded to the nearest power of two:
#: DistributedShampoo holds ``lr`` in a float32 tensor, which would round 0.01 at 2e-10.
LR_SGD = 2.0**-7
LR_ADAM = 2.0**-10
#: The README's epsilon is 1e-12; on the rank-deficient factors of a few steps of a tiny
#: model, ``(F + 1e-12·I)^(-1/4)`` magnifies rounding ~1e3-fold per refresh, so runs that
#: coincide in exact arithmetic drift apart at 1e-7.  The exact cases use 1e-6 (they
#: then agree at 1e-14); ``example4_adamw_readme_epsilon`` keeps 1e-12.
EPS = 1e-6


def digits(n_batches: int, batch: int = BATCH) -> list[tuple[Tensor, Tensor]]:
    """Consecutive batches of sklearn's digits, pixels scaled to [0, 1], float64."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x / 16.0, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.int64)
    return [
        (xt[i * batch : (i + 1) * batch], yt[i * batch : (i + 1) * batch]) for i in range(n_batches)
    ]


def mlp(hidden: int = 16) -> nn.Module:
    """64 → hidden → 10, ReLU, float64."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)).double()


class SmallCNN(nn.Module):
    """One 3×3 convolution (4 channels, stride 2: 4×4 = 16 output positions), a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 16, 10)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.conv(x.reshape(-1, 1, 8, 8)))
        return self.fc(h.flatten(1))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "mlp8": lambda: mlp(8), "cnn": SmallCNN}


# -- K-FAC: kfac-pytorch's examples/vision -------------------------------------------------
@dataclass(frozen=True)
class KaisaCase:
    """One run of kfac-pytorch's training loop (examples/vision/engine.py)."""

    model: str = "mlp"
    steps: int = 12
    accumulation_steps: int = 1
    options: dict[str, Any] = field(default_factory=dict)  # over the example's arguments
    compute_method: str = "EIGEN"
    strategy: str = "COMM_OPT"
    exp_decay: bool = False  # factor_decay=kfac.hyperparams.exp_decay_factor_averaging()
    float64_decompositions: bool = True  # see peers_reference_data: KAISA's float32 casts


def rising_damping(step: int) -> float:
    """A damping that changes at every step (KAISA passes its step count)."""
    return 0.003 * (1 + step)


KAISA_CASES = {
    # the example's defaults (torch_cifar10_resnet.py), eigen and inverse
    "example_eigen": KaisaCase(),
    "example_inverse": KaisaCase(compute_method="INVERSE"),
    # batches_per_allreduce=2: the loss divided by 2, K-FAC's accumulation_steps=2
    "example_accumulation": KaisaCase(accumulation_steps=2, steps=6),
    # the README's minimal use: KFACPreconditioner(model) with the defaults
    "defaults": KaisaCase(options={"use_defaults": True}),
    # factors every 2 steps, decompositions every 4, string spellings, MEM_OPT on 1 rank
    "intervals": KaisaCase(
        options={"factor_update_steps": 2, "inv_update_steps": 4, "damping": 0.01},
        compute_method="eigen",
        strategy="MEM_OPT",
    ),
    # KAISA as shipped: eigendecompositions in float32
    "example_eigen_float32": KaisaCase(float64_decompositions=False),
    # one step of a conv net with no identity start: the factors' documented scale
    "conv_factors": KaisaCase(model="cnn", steps=1, exp_decay=True),
    # a damping schedule between decompositions: KAISA's default folds λ into the
    # eigenvalues when it decomposes (frozen until the next), without it reads λ each step
    "damping_schedule": KaisaCase(
        options={"inv_update_steps": 4, "damping": rising_damping},
    ),
    "damping_schedule_per_step": KaisaCase(
        options={
            "inv_update_steps": 4,
            "damping": rising_damping,
            "compute_eigenvalue_outer_product": False,
        },
    ),
}


def kaisa_kwargs(
    kfac: ModuleType, case: KaisaCase, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """kfac-pytorch's example arguments (examples/vision/optimizers.py) for ``case``."""
    if case.options.get("use_defaults"):
        return {"inv_dtype": torch.float64}
    kw: dict[str, Any] = {
        "factor_update_steps": 1,
        "inv_update_steps": 10,
        "damping": 0.003,
        "factor_decay": 0.95,
        "kl_clip": 0.001,
        "lr": lambda x: optimizer.param_groups[0]["lr"],
        "accumulation_steps": case.accumulation_steps,
        "allreduce_bucket_cap_mb": 25,
        "colocate_factors": True,
        "compute_method": (
            getattr(kfac.enums.ComputeMethod, case.compute_method)
            if case.compute_method.isupper()
            else case.compute_method
        ),
        "grad_worker_fraction": getattr(kfac.enums.DistributedStrategy, case.strategy),
        "grad_scaler": None,
        "skip_layers": [],
        "inv_dtype": torch.float64,
    }
    if case.exp_decay:
        # kfac-pytorch's package does not import its hyperparams module itself
        hyperparams = importlib.import_module(f"{kfac.__name__}.hyperparams")
        kw["factor_decay"] = hyperparams.exp_decay_factor_averaging()
    kw.update({k: v for k, v in case.options.items() if k != "use_defaults"})
    return kw


def run_kaisa(
    kfac: ModuleType, case: KaisaCase, init: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[float], Any]:
    """Train ``case`` with ``kfac``'s preconditioner; parameters, losses, it."""
    model = MODELS[case.model]()
    model.load_state_dict(init)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    preconditioner = kfac.preconditioner.KFACPreconditioner(
        model, **kaisa_kwargs(kfac, case, optimizer)
    )
    data = digits(case.steps * case.accumulation_steps)
    losses = []
    for i in range(case.steps):
        optimizer.zero_grad()
        total = 0.0
        for j in range(case.accumulation_steps):
            x, y = data[i * case.accumulation_steps + j]
            loss = F.cross_entropy(model(x), y) / case.accumulation_steps
            loss.backward()
            total += float(loss.detach())
        preconditioner.step()
        optimizer.step()
        losses.append(total)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return final, losses, preconditioner


# -- Shampoo: DistributedShampoo's README examples --------------------------------------------
@dataclass(frozen=True)
class ShampooCase:
    """One README example: ``build(ds, params)`` returns the optimizer."""

    build: Callable[[ModuleType, Any], torch.optim.Optimizer]
    model: str = "mlp8"
    steps: int = 8


def _float64_root_inv(ds: ModuleType) -> Any:
    return ds.RootInvShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64
    )


def example1_sgd_momentum(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """README example 1 (SGD with momentum)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_SGD,
        betas=(0.0, 0.999),
        epsilon=EPS,
        weight_decay=1e-05,
        max_preconditioner_dim=32,
        precondition_frequency=2,
        grafting_config=ds.SGDPreconditionerConfig(),
        iterate_averaging_config=ds.shampoo_types.ClassicMomentumConfig(
            momentum=0.9, dampening=0.0, use_nesterov=False
        ),
        preconditioner_config=_float64_root_inv(ds),
    )


def example2_adam(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """README example 2 (Adam, L2 weight decay)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_ADAM,
        betas=(0.9, 0.999),
        epsilon=EPS,
        weight_decay=1e-05,
        max_preconditioner_dim=32,
        precondition_frequency=2,
        weight_decay_type=ds.WeightDecayType.L2,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
        preconditioner_config=_float64_root_inv(ds),
    )


def example3_adagrad(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """README example 3 (AdaGrad)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_SGD,
        betas=(0.0, 1.0),
        epsilon=EPS,
        weight_decay=1e-05,
        max_preconditioner_dim=32,
        precondition_frequency=2,
        weight_decay_type=ds.WeightDecayType.L2,
        grafting_config=ds.AdaGradPreconditionerConfig(epsilon=1e-10),
        preconditioner_config=_float64_root_inv(ds),
    )


def example4_adamw(
    ds: ModuleType, params: Any, max_dim: float = 32, epsilon: float = EPS
) -> torch.optim.Optimizer:
    """README example 4 (AdamW)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_ADAM,
        betas=(0.9, 0.999),
        epsilon=epsilon,
        weight_decay=1e-05,
        max_preconditioner_dim=max_dim,
        precondition_frequency=2,
        weight_decay_type=ds.WeightDecayType.DECOUPLED,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
        preconditioner_config=_float64_root_inv(ds),
    )


def example5_soap(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """README example 5 (eigenvalue-corrected Shampoo, eigh)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_ADAM,
        betas=(0.9, 0.999),
        epsilon=EPS,
        weight_decay=1e-05,
        max_preconditioner_dim=32,
        precondition_frequency=2,
        weight_decay_type=ds.WeightDecayType.DECOUPLED,
        preconditioner_config=ds.EigenvalueCorrectedShampooPreconditionerConfig(
            factor_matrix_dtype=torch.float64,
            factor_matrix_eigenvectors_dtype=torch.float64,
            corrected_eigenvalues_dtype=torch.float64,
        ),
    )


def soap_every_step(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """Example 5's SOAP with the eigenbasis refreshed every step, no bias correction, β₁ = 0."""
    return ds.DistributedShampoo(
        params,
        lr=LR_ADAM,
        betas=(0.0, 0.999),
        epsilon=EPS,
        max_preconditioner_dim=32,
        precondition_frequency=1,
        use_bias_correction=False,
        preconditioner_config=ds.EigenvalueCorrectedShampooPreconditionerConfig(
            factor_matrix_dtype=torch.float64,
            factor_matrix_eigenvectors_dtype=torch.float64,
            corrected_eigenvalues_dtype=torch.float64,
        ),
    )


def example7_classic_momentum(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """README example 7 (SGD preconditioner with classic momentum: plain SGD)."""
    return ds.DistributedShampoo(
        params,
        lr=LR_SGD,
        betas=(0.0, 1.0),
        epsilon=1e-12,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        preconditioner_config=ds.SGDPreconditionerConfig(),
        iterate_averaging_config=ds.shampoo_types.ClassicMomentumConfig(
            momentum=0.9, dampening=0.0, use_nesterov=False
        ),
    )


def eigendecomposed(ds: ModuleType, params: Any) -> torch.optim.Optimizer:
    """Eigendecomposed Shampoo (the roots kept as eigenvectors and eigenvalues), Adam grafting."""
    return ds.DistributedShampoo(
        params,
        lr=LR_ADAM,
        betas=(0.9, 0.999),
        epsilon=EPS,
        max_preconditioner_dim=32,
        precondition_frequency=2,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
        preconditioner_config=ds.EigendecomposedShampooPreconditionerConfig(
            factor_matrix_dtype=torch.float64,
            factor_matrix_eigenvectors_dtype=torch.float64,
            factor_matrix_eigenvalues_dtype=torch.float64,
        ),
    )


SHAMPOO_CASES = {
    "example1_sgd_momentum": ShampooCase(example1_sgd_momentum),
    "example2_adam": ShampooCase(example2_adam),
    "example3_adagrad": ShampooCase(example3_adagrad),
    "example4_adamw": ShampooCase(example4_adamw),
    "example4_adamw_merged": ShampooCase(lambda ds, p: example4_adamw(ds, p, max_dim=math.inf)),
    "example4_adamw_readme_epsilon": ShampooCase(
        lambda ds, p: example4_adamw(ds, p, epsilon=1e-12)
    ),
    "example5_soap": ShampooCase(example5_soap),
    "soap_every_step": ShampooCase(soap_every_step),
    "example7_classic_momentum": ShampooCase(example7_classic_momentum),
    "eigendecomposed": ShampooCase(eigendecomposed),
}


def run_shampoo(
    ds: ModuleType, case: ShampooCase, init: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[float]]:
    """Train ``case`` with ``ds``'s DistributedShampoo; final parameters and losses."""
    model = MODELS[case.model]()
    model.load_state_dict(init)
    optimizer = case.build(ds, model.parameters())
    losses = []
    for x, y in digits(case.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return final, losses
