"""The padded Cholesky: which sizes are padded, and that padding changes no answer.

Every answer is compared with ``torch.linalg`` on the unpadded matrix: the solve with
``torch.linalg.solve``, the factor with ``torch.linalg.cholesky``, the inverse by its
definition, definiteness with ``torch.linalg.eigvalsh``.
"""

from __future__ import annotations

import pytest
import torch

import secondorder.tuning
from secondorder._lapack import factor_size, pad_identity, shifted_cholesky_solve
from secondorder.kfac.layers.base import spd_cholesky, spd_inverse


@pytest.fixture
def padding():
    """Padding turned on for one test (it is off unless the user asks)."""
    previous = secondorder.tuning.pad_cpu_cholesky(True)
    yield
    secondorder.tuning.pad_cpu_cholesky(previous)


@pytest.fixture(params=[False, True], ids=["unpadded", "padded"])
def either(request: pytest.FixtureRequest):
    """Each test once without and once with the padding."""
    previous = secondorder.tuning.pad_cpu_cholesky(request.param)
    yield
    secondorder.tuning.pad_cpu_cholesky(previous)


def test_padding_is_off_unless_asked_for() -> None:
    assert factor_size(256, torch.float64, "cpu") == 256
    k = _spd(256, torch.float64)
    assert pad_identity(k) is k
    with pytest.raises(TypeError, match=r"Invalid enabled='yes': must be True or False"):
        secondorder.tuning.pad_cpu_cholesky("yes")  # type: ignore[arg-type]


def _spd(n: int, dtype: torch.dtype, batch: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n + 3, generator=gen, dtype=torch.float64)
    k = a @ a.mT / n + 0.1 * torch.eye(n, dtype=torch.float64)
    return ((k + k.mT) / 2).to(dtype)


@pytest.mark.parametrize(
    ("n", "dtype", "size"),
    [
        (100, torch.float64, 100),
        (128, torch.float64, 128),  # 1 KiB columns, but too small to matter
        (256, torch.float64, 272),  # 2 KiB columns
        (264, torch.float64, 264),
        (384, torch.float64, 400),
        (256, torch.float32, 272),  # 1 KiB columns
        (384, torch.float32, 384),  # 1.5 KiB
        (512, torch.float32, 528),
        (1024, torch.float64, 1040),
        (1281, torch.float64, 1296),  # large odd sizes are rounded up to 16
        (1296, torch.float64, 1296),
    ],
)
def test_factor_size(n: int, dtype: torch.dtype, size: int, padding: None) -> None:
    assert factor_size(n, dtype, "cpu") == size
    assert factor_size(n, dtype, "meta") == n  # only the CPU's LAPACK is padded
    # The size factored at never has 1 KiB columns itself.
    if size >= 256:
        assert (size * dtype.itemsize) % 1024 != 0


def test_pad_identity_is_blockdiag_and_returns_the_matrix_when_it_fits() -> None:
    k = _spd(5, torch.float64, batch=(2,))
    assert pad_identity(k, 5) is k
    p = pad_identity(k, 8)
    expect = torch.stack([torch.block_diag(k[i], torch.eye(3, dtype=k.dtype)) for i in range(2)])
    assert torch.equal(p, expect)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [7, 256, 264, 512])
def test_shifted_cholesky_solve_matches_torch_solve(
    n: int, dtype: torch.dtype, either: None
) -> None:
    k = _spd(n, dtype)
    kept = k.clone()
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    shift = torch.rand(n, generator=gen, dtype=torch.float64).to(dtype) * 0.01
    x, info = shifted_cholesky_solve(k, shift, b)
    assert int(info) == 0 and x.dtype == dtype and x.shape == (n,)
    ref = torch.linalg.solve(k.double() + torch.diag(shift.double()), b)
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    assert torch.allclose(x.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert torch.equal(k, kept)  # k is left as it was
    # A scalar shift means the same as that value on every diagonal entry.
    x1, _ = shifted_cholesky_solve(k, 0.5, b)
    ref1 = torch.linalg.solve(k.double() + 0.5 * torch.eye(n, dtype=torch.float64), b)
    assert torch.allclose(x1.double(), ref1, rtol=tol, atol=tol * float(ref1.abs().max()))


@pytest.mark.parametrize("n", [6, 256])
def test_shifted_cholesky_solve_reports_an_indefinite_matrix(n: int, either: None) -> None:
    # Padded or not, info is nonzero exactly when k + shift is not positive definite:
    # the identity block never hides a failure in the top-left block.
    k = _spd(n, torch.float64)
    low = float(torch.linalg.eigvalsh(k)[0])
    _, ok = shifted_cholesky_solve(k, -0.5 * low, torch.ones(n, dtype=torch.float64))
    _, bad = shifted_cholesky_solve(k, -2.0 * low, torch.ones(n, dtype=torch.float64))
    assert int(ok) == 0
    assert 0 < int(bad) <= n


@pytest.mark.parametrize("n", [5, 256, 512])
def test_kfac_inverse_and_factor_through_the_padding(n: int, either: None) -> None:
    k = _spd(n, torch.float64, batch=(2,))
    inv = spd_inverse(k)
    assert inv.shape == k.shape
    eye = torch.eye(n, dtype=k.dtype).expand_as(k)
    assert torch.allclose(k @ inv, eye, rtol=0.0, atol=1e-10)
    u = spd_cholesky(k)
    assert u.shape == k.shape
    assert torch.allclose(u, torch.linalg.cholesky(k).mT, rtol=1e-10, atol=1e-10)
