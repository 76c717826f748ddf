"""Install the two reference implementations as benchmark peers: ``make bench-peers``.

kfac-pytorch (KAISA) and facebookresearch/optimizers (DistributedShampoo) are not on
PyPI.  This script builds one benchmark virtual environment, ``out/peers/venv``, that
holds torch, secondorder (editable, from this checkout) and both references at pinned
commits, so that a benchmark can time ours and theirs in the same process::

    python -m benchmarks.peers                       # from PEERS_DIR, else from git
    python -m benchmarks.peers --peers-dir ../shared/peers
    python -m benchmarks.peers --from-git            # the public repositories

Sources, in order: ``--peers-dir`` (or the ``PEERS_DIR`` environment variable), a
directory holding ``kfac-pytorch-<commit>.tar.gz`` and ``optimizers-<commit>.tar.gz``
(each unpacks into ``src/``) or the two unpacked source trees; else ``../shared/peers``
next to this checkout when it exists; else ``pip install git+https://github.com/...@<commit>``.
The references are installed with ``--no-deps`` into the benchmark venv only: they are
no dependency of secondorder, and none of their code enters this repository.

DistributedShampoo needs Python >= 3.12.  The interpreter is ``--python`` (or
``PEERS_PYTHON``), else the first ``python3.13``/``python3.12`` found on PATH or under
pyenv.  With no such interpreter the venv is built with the current Python and only
kfac-pytorch is installed; the manifest says so.  torch is ``TORCH_SPEC`` (default
``torch==2.13.0``) from the configured index (``TORCH_INDEX`` to override): on Python
3.12 that is PyPI's build of the same release, which carries CUDA libraries and runs on
the CPU.  The result is recorded in ``out/peers/peers.json``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "peers"


@dataclass(frozen=True)
class Peer:
    """One reference implementation, pinned to a commit."""

    name: str  # distribution name, for messages
    module: str  # what `import` checks
    repo: str
    commit: str
    archive: str  # file name in PEERS_DIR
    min_python: tuple[int, int]


PEERS = (
    Peer(
        name="kfac-pytorch",
        module="kfac",
        repo="https://github.com/gpauloski/kfac-pytorch",
        commit="869cf11",
        archive="kfac-pytorch-869cf11.tar.gz",
        min_python=(3, 10),
    ),
    Peer(
        name="DistributedShampoo (facebookresearch/optimizers)",
        module="distributed_shampoo",
        repo="https://github.com/facebookresearch/optimizers",
        commit="f606606",
        archive="optimizers-f606606.tar.gz",
        min_python=(3, 12),
    ),
)


def run(cmd: list[str], **kw: object) -> str:
    shown = ["<script>" if "\n" in c else c for c in cmd]
    print("+", " ".join(shown), flush=True)
    done = subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    return str(done.stdout)


def python_version(exe: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [exe, "-c", "import sys; print(*sys.version_info[:2])"],
            check=True,
            text=True,
            capture_output=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out[0]), int(out[1])


def find_python(requested: str | None) -> str:
    """The interpreter for the venv: the requested one, else the newest 3.12+ found."""
    if requested:
        if python_version(requested) is None:
            raise SystemExit(f"Invalid --python={requested!r}: it does not run.")
        return requested
    candidates = [shutil.which(n) for n in ("python3.13", "python3.12")]
    home = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(str(home / "versions" / "3.1[2-9]*" / "bin" / "python")))
    for c in candidates:
        if c and (python_version(c) or (0, 0)) >= (3, 12):
            return c
    return sys.executable


def default_peers_dir() -> Path | None:
    env = os.environ.get("PEERS_DIR")
    if env:
        return Path(env)
    shared = ROOT.parent / "shared" / "peers"
    if shared.is_dir():
        return shared
    # a git worktree lives one level deeper than the main checkout
    shared = ROOT.parent.parent / "shared" / "peers"
    return shared if shared.is_dir() else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_of(peer: Peer, peers_dir: Path | None) -> tuple[str, dict[str, str]]:
    """What pip installs for ``peer`` and how it was found (for the manifest)."""
    if peers_dir is None:
        return f"git+{peer.repo}@{peer.commit}", {"source": f"{peer.repo}@{peer.commit}"}
    archive = peers_dir / peer.archive
    if archive.is_file():
        dest = OUT / "src" / peer.archive.removesuffix(".tar.gz")
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        return str(dest / "src"), {"source": str(archive), "sha256": sha256(archive)}
    tree = peers_dir / peer.archive.removesuffix(".tar.gz")
    for candidate in (tree / "src", tree):
        if (candidate / "pyproject.toml").is_file():
            return str(candidate), {"source": str(candidate)}
    raise SystemExit(
        f"PEERS_DIR={str(peers_dir)!r} holds neither {peer.archive} nor its unpacked tree "
        f"{tree.name}/; pass --from-git to install {peer.name} from {peer.repo}."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers-dir", type=Path, default=None, help="archives or source trees")
    ap.add_argument("--from-git", action="store_true", help="install from the public repos")
    ap.add_argument("--python", default=os.environ.get("PEERS_PYTHON"))
    ap.add_argument("--venv", type=Path, default=OUT / "venv")
    ap.add_argument("--torch-spec", default=os.environ.get("TORCH_SPEC", "torch==2.13.0"))
    ap.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX", ""))
    args = ap.parse_args(argv)

    peers_dir = None if args.from_git else (args.peers_dir or default_peers_dir())
    exe = find_python(args.python)
    version = python_version(exe) or (0, 0)
    venv: Path = args.venv
    py = venv / "bin" / "python"
    if not py.exists():
        run([exe, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q"]
    run([*pip, "--upgrade", "pip"])
    index = ["--index-url", args.torch_index] if args.torch_index else []
    run([*pip, *index, args.torch_spec])
    # what the reference-data script and the side-by-side benchmarks import
    run([*pip, "numpy", "scikit-learn", "mnist1d"])
    run([*pip, "-e", str(ROOT)])

    manifest: dict[str, object] = {
        "venv": str(venv),
        "python": ".".join(map(str, version)),
        "torch_spec": args.torch_spec,
        "peers": [],
    }
    for peer in PEERS:
        entry: dict[str, object] = {**asdict(peer)}
        if version < peer.min_python:
            entry["installed"] = False
            entry["why"] = (
                f"needs Python >= {'.'.join(map(str, peer.min_python))}; the venv has "
                f"{'.'.join(map(str, version))} (pass --python python3.12)"
            )
            print(f"skipped {peer.name}: {entry['why']}", flush=True)
        else:
            target, found = source_of(peer, peers_dir)
            run([*pip, "--no-deps", target])
            entry.update(found, installed=True)
        manifest["peers"].append(entry)  # type: ignore[attr-defined]

    probe = (
        "import importlib, json, torch\n"
        "out = {'torch': torch.__version__}\n"
        "for m in ('kfac', 'distributed_shampoo', 'secondorder'):\n"
        "    try:\n"
        "        importlib.import_module(m); out[m] = 'ok'\n"
        "    except Exception as e:\n"
        "        out[m] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(out))\n"
    )
    imports = json.loads(run([str(py), "-W", "ignore", "-c", probe]).strip().splitlines()[-1])
    manifest["imports"] = imports
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peers.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    wanted = [p.module for p in PEERS if version >= p.min_python]
    failed = [m for m in wanted if imports.get(m) != "ok"]
    if failed:
        print(f"import failed in {venv}: {failed}", file=sys.stderr)
        return 1
    print(f"peers ready: {py}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
