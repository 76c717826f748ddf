"""Generate the references' runs that ``tests/compat`` compares the drop-ins with.

Run once, in the peers' venv (``make bench-peers``), from the repository root::

    out/peers/venv/bin/python -m benchmarks.peers_reference_data

It runs every case of :mod:`benchmarks.peers_cases` with kfac-pytorch's
``KFACPreconditioner`` and DistributedShampoo, and writes ``tests/compat/data/
kaisa_reference.pt`` and ``shampoo_reference.pt``: the initial parameters of each model,
each case's final parameters and losses, and (for ``conv_factors``) KAISA's factors.
The references are not test dependencies; only these files are.

kfac-pytorch casts every factor to float32 before its eigendecomposition or inverse,
whatever ``inv_dtype`` is.  To compare the algorithm rather than float32 rounding, cases
with ``float64_decompositions`` run with that cast made float64: the name ``torch`` in
``kfac.layers.eigen`` and ``kfac.layers.inverse`` is replaced, for the duration of the
case, by a proxy of torch whose ``float32`` is ``torch.float64`` (nothing else changes,
and nothing is written to the installed package).  ``example_eigen_float32`` runs
kfac-pytorch as shipped.

DistributedShampoo makes its bias corrections ``1 − βᵗ`` from ``torch.tensor(1.0)``,
which is float32 under torch's default dtype; its cases run with
``torch.set_default_dtype(torch.float64)`` so that those scalars are float64 like the
model (its learning rate stays a float32 tensor: the cases use powers of two).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import peers_cases as cases

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "out/peers/venv/bin/python -m benchmarks.peers_reference_data"


class _Float64Torch:
    """torch, except that ``float32`` is ``float64``."""

    float32 = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def float64_decompositions(enabled: bool) -> Iterator[None]:
    import kfac.layers.eigen as eigen
    import kfac.layers.inverse as inverse

    saved = eigen.torch, inverse.torch
    if enabled:
        eigen.torch = inverse.torch = _Float64Torch()  # type: ignore[assignment]
    try:
        yield
    finally:
        eigen.torch, inverse.torch = saved


def peer_versions() -> dict[str, Any]:
    manifest = ROOT / "out" / "peers" / "peers.json"
    peers = json.loads(manifest.read_text())["peers"] if manifest.exists() else []
    return {
        "torch": str(torch.__version__),
        "python": ".".join(map(str, sys.version_info[:3])),
        "peers": {p["module"]: {"commit": p["commit"], "source": p.get("source")} for p in peers},
        "secondorder_commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "command": COMMAND,
    }


def kaisa_data() -> dict[str, Any]:
    import kfac

    inits = {name: cases.MODELS[name]().state_dict() for name in ("mlp", "cnn")}
    out: dict[str, Any] = {"init": inits, "cases": {}}
    for name, case in cases.KAISA_CASES.items():
        with float64_decompositions(case.float64_decompositions):
            final, losses, pre = cases.run_kaisa(kfac, case, inits[case.model])
        entry: dict[str, Any] = {
            "final": final,
            "losses": torch.tensor(losses, dtype=torch.float64),
        }
        if name == "conv_factors":
            entry["factors"] = {
                lname: {"A": f["A"].clone(), "G": f["G"].clone()}
                for lname, f in pre.state_dict()["layers"].items()
            }
        out["cases"][name] = entry
        print(f"kfac-pytorch {name}: losses {[round(v, 4) for v in losses]}", flush=True)
    return out


def shampoo_data() -> dict[str, Any]:
    import distributed_shampoo as ds
    import distributed_shampoo.shampoo_types

    inits = {name: cases.MODELS[name]().state_dict() for name in ("mlp8",)}
    out: dict[str, Any] = {"init": inits, "cases": {}}
    for name, case in cases.SHAMPOO_CASES.items():
        torch.set_default_dtype(torch.float64)  # see the module docstring
        try:
            final, losses = cases.run_shampoo(ds, case, inits[case.model])
        finally:
            torch.set_default_dtype(torch.float32)
        out["cases"][name] = {"final": final, "losses": torch.tensor(losses, dtype=torch.float64)}
        print(f"DistributedShampoo {name}: losses {[round(v, 4) for v in losses]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "compat" / "data")
    ap.add_argument(
        "--only",
        choices=("kaisa", "shampoo"),
        help="write one reference's file only (its peer alone is installed)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meta = peer_versions()
    args.out.mkdir(parents=True, exist_ok=True)
    files = (
        ("kaisa", "kaisa_reference.pt", kaisa_data),
        ("shampoo", "shampoo_reference.pt", shampoo_data),
    )
    for which, fname, make in files:
        if args.only not in (None, which):
            continue
        data = make()
        data["meta"] = meta
        torch.save(data, args.out / fname)
        print(f"wrote {args.out / fname}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
