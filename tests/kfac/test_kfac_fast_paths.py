"""The speed-motivated code paths against their plain references.

Cholesky solves against the explicit Kronecker solve, strided conv rows against
``F.unfold``, the cached eigen scaling against a changed damping, the one-reduction
finiteness test against ``torch.isfinite``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC
from secondorder.kfac.layers import conv_patch_rows, conv_patches
from secondorder.kfac.layers.base import spd_cholesky, spd_inverse
from secondorder.kfac.packing import sums_finite

DT = torch.float64


def vec(m: torch.Tensor) -> torch.Tensor:
    return m.T.reshape(-1)


def kron_inverse_step(
    layer_A: torch.Tensor, layer_G: torch.Tensor, grad: torch.Tensor, lam: float
) -> torch.Tensor:
    ia = torch.eye(layer_A.shape[0], dtype=DT)
    ig = torch.eye(layer_G.shape[0], dtype=DT)
    return torch.linalg.solve(torch.kron(layer_A + lam * ia, layer_G + lam * ig), vec(grad))


@pytest.mark.parametrize(
    ("shape", "every", "keys"),
    [
        ((3, 9), 1, {"A_inv", "G_chol"}),  # wide output: G kept as its Cholesky factor
        ((9, 3), 1, {"A_chol", "G_inv"}),  # wide input: A kept as its Cholesky factor
        ((9, 3), 50, {"A_inv", "G_inv"}),  # rare inversions: explicit inverses
    ],
)
def test_inverse_method_forms_equal_the_kronecker_solve(
    shape: tuple[int, int], every: int, keys: set[str]
) -> None:
    torch.manual_seed(5)
    model = nn.Linear(*shape).to(DT)
    k = KFAC(
        model,
        compute_method="inverse",
        damping=0.2,
        factor_decay=0.5,
        kl_clip=None,
        inv_dtype=DT,
        factor_update_steps=every,
        inv_update_steps=every,
    )
    x = torch.randn(7, shape[0], dtype=DT)
    model(x).pow(2).sum().backward()
    layer = k.layers["<model>"]
    raw = layer.grad()
    assert raw is not None
    raw = raw.clone()
    k.step()
    assert set(layer.inv) == keys
    assert layer.A is not None and layer.G is not None
    expect = kron_inverse_step(layer.A[0], layer.G[0], raw[0], 0.2)
    got = layer.grad()
    assert got is not None
    torch.testing.assert_close(vec(got[0]), expect, rtol=1e-10, atol=1e-12)


def test_spd_cholesky_of_an_indefinite_rounding_is_finite_and_close() -> None:
    torch.manual_seed(6)
    a = torch.randn(40, 3)
    m = a @ a.T  # rank 3: rounding leaves eigenvalues of both signs near 0
    m.diagonal().sub_(1e-6)  # make sure it is indefinite
    assert int(torch.linalg.cholesky_ex(m).info) != 0
    chol = spd_cholesky(m)  # upper: m ≈ UᵀU
    assert bool(torch.isfinite(chol).all())
    assert torch.equal(chol, chol.triu())
    # UᵀU differs from m by the lift of the smallest eigenvalue (to n·eps·max diag)
    # and by float32 rounding of that size
    low = float(torch.linalg.eigvalsh(m.double())[0])
    rounding = 40 * torch.finfo(torch.float32).eps * float(m.diagonal().max())
    err = float((chol.T @ chol - m).abs().max())
    assert err <= abs(low) + 3 * rounding


@pytest.mark.parametrize("n", [520, 528])  # padded to a multiple of 16, and not
def test_spd_inverse_and_cholesky_of_a_large_factor(n: int) -> None:
    torch.manual_seed(9)
    a = torch.randn(n, n + 7, dtype=DT)
    m = (a @ a.T / n + 0.1 * torch.eye(n, dtype=DT)).unsqueeze(0)
    torch.testing.assert_close(spd_inverse(m), torch.linalg.inv(m), rtol=1e-9, atol=1e-9)
    u = spd_cholesky(m)
    assert u.shape == m.shape and torch.equal(u, u.triu())
    torch.testing.assert_close(u.mT @ u, m, rtol=1e-12, atol=1e-12)


CONV_CASES = [
    (1, dict(kernel_size=3)),
    (1, dict(kernel_size=3, stride=2, padding=2, dilation=2, groups=2)),
    (1, dict(kernel_size=2, padding="same", groups=4, padding_mode="reflect")),
    (1, dict(kernel_size=3, padding=2, padding_mode="circular", stride=3, dilation=2)),
    (2, dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1))),
    (2, dict(kernel_size=3, padding="same", groups=2, padding_mode="replicate")),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize(("nd", "kw"), CONV_CASES)
def test_conv_patch_rows_equal_unfold_patches_bitwise(nd: int, kw: dict[str, object]) -> None:
    torch.manual_seed(7)
    conv = (nn.Conv1d if nd == 1 else nn.Conv2d)(4, 4, **kw)  # type: ignore[arg-type]
    x = torch.randn(3, 4, *([9] * nd))
    p = conv_patches(conv, x)  # (N, C·k, L), F.unfold
    n, ck, length = p.shape
    g = conv.groups
    ref = p.reshape(n, g, ck // g, length).permute(1, 0, 3, 2).reshape(g, n * length, ck // g)
    rows = conv_patch_rows(conv, x)
    assert rows.shape == ref.shape
    assert torch.equal(rows, ref)


def test_eigen_scaling_follows_damping_between_decompositions() -> None:
    torch.manual_seed(8)
    model = nn.Linear(4, 3).to(DT)
    k = KFAC(
        model,
        damping=lambda s: 0.1 * (s + 1),
        factor_update_steps=10,
        inv_update_steps=10,
        kl_clip=None,
        inv_dtype=DT,
    )
    layer = k.layers["<model>"]
    for step in range(3):
        model.zero_grad()
        model(torch.randn(5, 4, dtype=DT)).pow(2).sum().backward()
        raw = layer.grad()
        assert raw is not None
        raw = raw.clone()
        k.step()
        assert layer.A is not None and layer.G is not None
        lam = 0.1 * (step + 1)
        n = layer.A.shape[-1] * layer.G.shape[-1]
        m = torch.kron(layer.A[0], layer.G[0]) + lam * torch.eye(n, dtype=DT)
        got = layer.grad()
        assert got is not None
        torch.testing.assert_close(
            vec(got[0]), torch.linalg.solve(m, vec(raw[0])), rtol=1e-10, atol=1e-12
        )


def test_sums_finite_agrees_with_isfinite() -> None:
    big = torch.finfo(torch.float32).max
    cases = [
        torch.ones(3),
        torch.tensor([big, big]),  # finite, but the sum overflows
        torch.tensor([1.0, float("inf")]),
        torch.tensor([float("inf"), float("-inf")]),
        torch.tensor([1.0, float("nan")]),
        torch.zeros(0),
        torch.tensor([-big, -big], dtype=torch.float32).double(),  # another dtype
    ]
    want = [bool(torch.isfinite(t).all()) for t in cases]
    assert want == [True, True, False, False, False, True, True]
    assert sums_finite(cases) == want  # one read for all of them
    assert sums_finite([]) == []
