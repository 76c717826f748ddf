"""curve_fit's ``full_output``: scipy's infodict keys and types, ours for a tensor ``p0``.

The reference is scipy.optimize.curve_fit on the same problem: every key it returns
is in ours with the same type (Python int, str, float64 or int32 NumPy array); a
tensor ``p0`` makes every array a tensor of the same dtype, as it does ``popt``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from secondorder.fitting import curve_fit

sopt = pytest.importorskip("scipy.optimize")

T = np.linspace(0.0, 4.0, 25)
Y = 2.0 * np.exp(-0.7 * T) + 0.3 + 0.01 * np.sin(7 * T)
P0 = [1.0, 0.5, 0.0]
SIGMA = 0.05 + 0.01 * T

#: The keys ours has beyond scipy's, as curve_fit's docstring lists them.
EXTRAS = {"lm": {"njev", "result"}, "trf": {"njev", "result", "fjac", "ipvt", "qtf"}}


def decay_np(x: Any, a: Any, b: Any, c: Any) -> Any:
    return a * np.exp(-b * x) + c


def decay_torch(x: Any, a: Any, b: Any, c: Any) -> Any:
    return a * torch.exp(-b * x) + c


def _numpy_kind(value: Any) -> tuple[Any, ...]:
    """What a scipy infodict entry is: its type, and an array's dtype and shape."""
    if isinstance(value, np.ndarray):
        return (np.ndarray, value.dtype, value.shape)
    return (type(value),)


@pytest.mark.parametrize("method", ["lm", "trf", "dogbox"])
@pytest.mark.parametrize("model", [decay_np, decay_torch], ids=["numpy-f", "torch-f"])
@pytest.mark.parametrize("tensor_p0", [False, True], ids=["list-p0", "tensor-p0"])
def test_full_output_has_scipys_keys_and_types(method: str, model: Any, tensor_p0: bool) -> None:
    ref = sopt.curve_fit(decay_np, T, Y, P0, sigma=SIGMA, method=method, full_output=True)
    p0 = torch.tensor(P0, dtype=torch.float64) if tensor_p0 else P0
    ours = curve_fit(model, T, Y, p0, sigma=SIGMA, method=method, full_output=True)
    popt, pcov, info, mesg, ier = ours
    ref_info = ref[2]
    assert set(ref_info) <= set(info)
    assert set(info) - set(ref_info) == EXTRAS["lm" if method == "lm" else "trf"]
    assert type(mesg) is str and type(ier) is int and type(mesg) is type(ref[3])
    assert type(ier) is type(ref[4]) and ier == ref[4]
    for key, value in ref_info.items():
        if tensor_p0 and isinstance(value, np.ndarray):
            # The convention of popt and pcov: tensors for a tensor p0, same dtype.
            assert isinstance(info[key], torch.Tensor), key
            assert info[key].dtype == torch.from_numpy(value).dtype, key
            assert tuple(info[key].shape) == value.shape, key
        else:
            assert _numpy_kind(info[key]) == _numpy_kind(value), key
    assert isinstance(popt, torch.Tensor) is tensor_p0
    assert isinstance(pcov, torch.Tensor) is tensor_p0
    # The values are scipy's: the weighted residuals at the optimum.
    np.testing.assert_allclose(np.asarray(info["fvec"]), ref_info["fvec"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(popt), ref[0], rtol=1e-6)
    res = info["result"]
    assert info["nfev"] == res.nfev and (info["njev"] is None) is (res.njev is None)
