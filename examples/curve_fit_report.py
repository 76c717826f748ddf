"""Nonlinear regression with parameter uncertainties: two peaks on a sloping background.

    python examples/curve_fit_report.py            # also compares with scipy when installed
    python examples/curve_fit_report.py --quick

A spectrum-like signal, two Gaussian peaks on a linear background, is sampled at 200
points with noise whose standard deviation is known.  ``so.curve_fit`` (scipy's call
and return values) fits the eight parameters with the noise level as ``sigma`` and
``absolute_sigma=True``, so the covariance is in the data's own units.  The printed
report lists each parameter ± one standard error, the strongly correlated pairs, the
chi-square and how the solver stopped.
"""

from __future__ import annotations

import argparse

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
