"""A physics-informed network for the 1-D Poisson equation, trained with LM.

    python examples/pinn_poisson.py            # a few seconds
    python examples/pinn_poisson.py --quick    # for CI

Solve ``u''(x) = f(x)`` on ``[0, 1]`` with ``u(0) = u(1) = 0`` and
``f(x) = -(π² sin(πx) + 16π² sin(4πx))``, whose exact solution is
``u(x) = sin(πx) + sin(4πx)``.  The network ``u_θ(x)`` is trained so that the residuals

* ``u_θ''(xᵢ) - f(xᵢ)`` at interior collocation points, and
* ``w·u_θ(0)``, ``w·u_θ(1)`` at the boundary (``w`` weights the boundary conditions),

vanish.  The second derivative in the input is taken with ``torch.func.hessian``
inside a :class:`secondorder.residuals.ModelResidual`, so the optimizer can
differentiate it once more with respect to the weights.  The relative L2 error
against the exact solution is reported on a fine grid, and plotted with the solution
in ``out/pinn_poisson.png``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

import secondorder as so
from secondorder.training import fit

PI = math.pi


def exact(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(PI * x) + torch.sin(4 * PI * x)


def forcing(x: torch.Tensor) -> torch.Tensor:
    return -(PI**2) * torch.sin(PI * x) - 16 * PI**2 * torch.sin(4 * PI * x)


def poisson_residual(boundary_weight: float):
    def residual(u, x, f):
        def scalar_u(s):
            return u(s.reshape(1, 1)).reshape(())

        u_xx = torch.func.vmap(torch.func.hessian(scalar_u))(x[:, 0])
        ends = torch.tensor([[0.0], [1.0]], dtype=x.dtype)
        return torch.cat([u_xx - f, boundary_weight * u(ends).reshape(-1)])

    return so.residuals.ModelResidual(residual)


def relative_l2(model: nn.Module, points: int = 1001) -> float:
    xs = torch.linspace(0, 1, points, dtype=torch.float64).unsqueeze(1)
    with torch.no_grad():
        err = model(xs) - exact(xs)
    return float(torch.linalg.vector_norm(err) / torch.linalg.vector_norm(exact(xs)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast, for CI")
    parser.add_argument("--points", type=int, default=64, help="interior collocation points")
    parser.add_argument("--hidden", type=int, default=32, help="units per hidden layer")
    parser.add_argument("--layers", type=int, default=1, help="hidden layers")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    args = parser.parse_args(argv)
    if args.quick:
        args.points, args.hidden, args.layers, args.steps = 32, 24, 1, 80

    torch.manual_seed(args.seed)
    layers: list[nn.Module] = [nn.Linear(1, args.hidden), nn.Tanh()]
    for _ in range(args.layers - 1):
        layers += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(args.hidden, 1)).double()
    x = torch.linspace(0, 1, args.points + 2, dtype=torch.float64)[1:-1].unsqueeze(1)
    f = forcing(x[:, 0])

    opt = so.LevenbergMarquardt(model, poisson_residual(boundary_weight=10.0))
    print(f"{args.points} collocation points, {opt.num_parameters} parameters")
    print(f"relative L2 error before training: {relative_l2(model):.3e}")
    history = fit(opt, (x, f), epochs=args.steps, validation=lambda: relative_l2(model),
                  progress=not args.quick)  # fmt: skip
    error = relative_l2(model)
    print(
        f"LM: {len(history)} steps in {history.time[-1]:.2f} s, residual mean square "
        f"{history.loss[-1]:.2e}, relative L2 error {error:.3e}"
    )
    print(f"    ({history.stop_reason})")
    plot(model, history, args.out)


def plot(model: nn.Module, history, out: Path) -> None:
    """The network against the exact solution, and the error against training time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, (ax, ex) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = torch.linspace(0, 1, 401, dtype=torch.float64).unsqueeze(1)
    with torch.no_grad():
        ax.plot(xs[:, 0], model(xs)[:, 0], label="network")
    ax.plot(xs[:, 0], exact(xs)[:, 0], "k--", linewidth=0.8, label="sin(πx) + sin(4πx)")
    ax.set_xlabel("x")
    ax.set_ylabel("u(x)")
    ax.set_title("u'' = f on [0, 1], u(0) = u(1) = 0")
    ax.legend()
    ex.semilogy([e.time for e in history.epochs], history.validation)
    ex.set_xlabel("training time (s)")
    ex.set_ylabel("relative L2 error")
    ex.set_title(f"Levenberg-Marquardt, {len(history)} steps")
    ex.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out / "pinn_poisson.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
