"""Count the cases behind the README's Reliability section, by outcome.

    python -m benchmarks.reliability [--slow]

Runs pytest on the reliability test files below, grouped by family (without the
``slow`` ones unless ``--slow``), with a small plugin that notes, for every test case,
how it judges the library: a case that enters ``pytest.raises`` checks an error (a
refusal of bad input, or an interrupt that must propagate and leave the state as it
was: the exception's type and message, then whatever the case asserts after it), one
that enters ``pytest.warns`` a warning, and any other case compares a result with a
reference (``torch.func``, scipy, a fresh optimizer, one process on the concatenated
batch, NIST's certified values, ...). Prints the counts per file, per family and in
all, with pytest's outcome of each case, so the README's figures come from this
command on the current code.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterator
from typing import Any

import pytest

#: The files behind the README's Reliability section, by family.
FAMILIES: dict[str, tuple[str, ...]] = {
    "Levenberg-Marquardt and fitting": (
        "tests/lm/test_hardening.py",
        "tests/lm/test_properties.py",
        "tests/lm/test_coupling.py",
        "tests/lm/test_model_kinds.py",
        "tests/lm/test_lm_trust.py",
        "tests/lm/test_checkpoint.py",
        "tests/lm/test_step_interrupt.py",
        "tests/lm/test_step_inputs.py",
        "tests/lm/test_narrow_overflow.py",
        "tests/lm/test_device_replicas.py",
        "tests/lm/test_capturable_state.py",
        "tests/fitting/test_fitting_trust.py",
        "tests/fitting/test_nist_strd.py",
        "tests/fitting/test_fun_changes.py",
        "tests/fitting/test_batch_arguments.py",
        "tests/training/test_fit_checks.py",
        "tests/training/test_validation_first.py",
        "tests/distributed/test_distributed_faults.py",
        "tests/distributed/test_rank_agreement.py",
        "tests/distributed/test_settings_agree.py",
    ),
    "K-FAC": (
        "tests/kfac/test_kfac_atomic.py",
        "tests/kfac/test_kfac_abandoned_pass.py",
        "tests/kfac/test_kfac_checkpoint_values.py",
        "tests/kfac/test_kfac_layer_checks.py",
        "tests/kfac/test_kfac_half_and_lr.py",
        "tests/kfac/test_kfac_rank_faults.py",
        "tests/kfac/test_kfac_rank_refusals.py",
        "tests/kfac/test_kfac_optimizer_step.py",
        "tests/kfac/test_kfac_step_fault_sweep.py",
        "tests/kfac/test_kfac_load_fault_sweep.py",
        "tests/kfac/test_kfac_load_drops_pending.py",
        "tests/kfac/test_kfac_compat_checkpoints.py",
    ),
    "Shampoo and SOAP": (
        "tests/shampoo/test_shampoo_faults.py",
        "tests/shampoo/test_shampoo_distributed_faults.py",
    ),
}
FILES = tuple(path for paths in FAMILIES.values() for path in paths)


class Census:
    """A pytest plugin: the kind of check each case made and its outcome."""

    def __init__(self) -> None:
        self.kind: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self._current: str | None = None
        self._raises = pytest.raises
        self._warns = pytest.warns

    def _mark(self, kind: str) -> None:
        if self._current is not None and self.kind.get(self._current) != "refusal":
            self.kind[self._current] = kind

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        self._current = item.nodeid
        self.kind.setdefault(item.nodeid, "result")
        census = self

        def raises(*args: Any, **kwargs: Any) -> Any:
            census._mark("refusal")
            return census._raises(*args, **kwargs)

        def warns(*args: Any, **kwargs: Any) -> Any:
            census._mark("warning")
            return census._warns(*args, **kwargs)

        pytest.raises, pytest.warns = raises, warns
        try:
            return (yield)
        finally:
            pytest.raises, pytest.warns = self._raises, self._warns
            self._current = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcome.get(report.nodeid)
            if previous in (None, "passed"):
                self.outcome[report.nodeid] = report.outcome
        self.kind.setdefault(report.nodeid, "result")


def main(argv: list[str] | None = None) -> int:
    """Run the files, print the census; the exit status is pytest's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow", action="store_true", help="include the tests marked slow")
    args = ap.parse_args(argv)
    census = Census()
    marker = [] if args.slow else ["-m", "not slow"]
    status = pytest.main(["-q", "-p", "no:cacheprovider", *marker, *FILES], plugins=[census])
    rows: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for nodeid, outcome in census.outcome.items():
        path = nodeid.split("::")[0]
        rows[path][f"{census.kind.get(nodeid, 'result')}:{outcome}"] += 1
    keys = ["result", "refusal", "warning"]
    print(
        "\n| file | cases | result against a reference | error (type and message) "
        "| warning | not passed |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    total: collections.Counter[str] = collections.Counter()
    for family, paths in FAMILIES.items():
        subtotal: collections.Counter[str] = collections.Counter()
        for path in paths:
            c = rows.get(path, collections.Counter())
            subtotal.update(c)
            print(_row(path, c, keys))
        total.update(subtotal)
        print(_row(f"*{family}*", subtotal, keys))
    print(_row("**all**", total, keys))
    return int(status)


def _row(name: str, c: collections.Counter[str], keys: list[str]) -> str:
    cases = sum(c.values())
    passed = [sum(v for k, v in c.items() if k == f"{kind}:passed") for kind in keys]
    other = cases - sum(passed) - sum(v for k, v in c.items() if k.endswith(":skipped"))
    skipped = sum(v for k, v in c.items() if k.endswith(":skipped"))
    note = f"{other}" + (f" ({skipped} skipped)" if skipped else "")
    return f"| {name} | {cases} | {passed[0]} | {passed[1]} | {passed[2]} | {note} |"


if __name__ == "__main__":
    sys.exit(main())
