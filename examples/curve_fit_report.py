"""Nonlinear regression with parameter uncertainties: two peaks on a sloping background.

    python examples/curve_fit_report.py            # also compares with scipy when installed
    python examples/curve_fit_report.py --quick

A spectrum-like signal, two Gaussian peaks on a linear background, is sampled at 200
points with noise whose standard deviation is known.  ``so.curve_fit`` (scipy's call
and return values) fits the eight parameters with the noise level as ``sigma`` and
``absolute_sigma=True``, so the covariance is in the data's own units.  The printed
report lists each parameter ± one standard error, the strongly correlated pairs, the
chi-square and how the solver stopped.  The data, the fit and its two peaks, and the
residuals in units of sigma are plotted in ``out/curve_fit_report.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from secondorder.fitting import curve_fit, fit_report

NAMES = ["amp1", "center1", "width1", "amp2", "center2", "width2", "slope", "offset"]
TRUE = [3.0, -1.0, 0.4, 1.5, 0.8, 0.6, 0.2, 0.5]


def model(x, a1, c1, w1, a2, c2, w2, slope, offset):
    """Two Gaussian peaks and a straight line, written with torch (exact derivatives)."""
    peak1 = a1 * torch.exp(-((x - c1) ** 2) / (2 * w1**2))
    peak2 = a2 * torch.exp(-((x - c2) ** 2) / (2 * w2**2))
    return peak1 + peak2 + slope * x + offset


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="accepted for CI; already quick")
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    x = np.linspace(-3, 3, 200)
    clean = model(torch.tensor(x), *torch.tensor(TRUE)).numpy()
    sigma = np.full_like(x, args.noise)
    y = clean + sigma * rng.standard_normal(x.size)
    p0 = [2.0, -0.8, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]

    popt, pcov, info, _mesg, _ier = curve_fit(
        model, x, y, p0, sigma=sigma, absolute_sigma=True, full_output=True
    )
    report = fit_report(info["result"], names=NAMES, absolute_sigma=True, min_correlation=0.3)
    print(report)
    print()
    pulls = (popt - np.array(TRUE)) / report.stderr
    print("(fitted - true) / standard error:", np.array2string(pulls, precision=2))
    print(f"reduced chi-square {report.redchi:.3f} (about 1 when sigma is the true noise level)")
    compare_with_scipy(x, y, sigma, p0, popt, pcov)
    plot(x, y, sigma, popt, args.out)


def plot(x, y, sigma, popt, out: Path) -> None:
    """The data with the fit and its parts above, the residuals / sigma below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, (ax, rx) = plt.subplots(
        2, 1, figsize=(7.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    xt = torch.tensor(x)
    fitted = model(xt, *torch.tensor(popt)).numpy()
    a1, c1, w1, a2, c2, w2, slope, offset = popt
    background = slope * x + offset
    ax.errorbar(x, y, yerr=sigma, fmt=".", markersize=3, color="0.5", label="data ± sigma")
    ax.plot(x, fitted, label="so.curve_fit")
    for a, c, w, name in ((a1, c1, w1, "peak 1"), (a2, c2, w2, "peak 2")):
        peak = a * np.exp(-((x - c) ** 2) / (2 * w**2))
        ax.plot(x, background + peak, "--", linewidth=0.8, label=f"{name} + background")
    ax.set_ylabel("y")
    ax.set_title("two Gaussian peaks on a sloping background")
    ax.legend(fontsize=8)
    rx.plot(x, (y - fitted) / sigma, ".", markersize=3)
    rx.axhline(0, color="k", linewidth=0.8)
    rx.set_xlabel("x")
    rx.set_ylabel("residual / sigma")
    fig.tight_layout()
    path = out / "curve_fit_report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def compare_with_scipy(x, y, sigma, p0, popt, pcov) -> None:
    try:
        import scipy.optimize as sopt
    except ImportError:
        return

    def model_np(x, a1, c1, w1, a2, c2, w2, slope, offset):
        peak1 = a1 * np.exp(-((x - c1) ** 2) / (2 * w1**2))
        peak2 = a2 * np.exp(-((x - c2) ** 2) / (2 * w2**2))
        return peak1 + peak2 + slope * x + offset

    ref, ref_cov = sopt.curve_fit(model_np, x, y, p0, sigma=sigma, absolute_sigma=True)
    print()
    print("scipy.optimize.curve_fit on the same data:")
    print(f"  max |popt - scipy|  / |scipy|  = {np.abs(popt - ref).max() / np.abs(ref).max():.1e}")
    rel = np.abs(pcov - ref_cov).max() / np.abs(ref_cov).max()
    print(f"  max |pcov - scipy| / |scipy| = {rel:.1e}")


if __name__ == "__main__":
    main()
