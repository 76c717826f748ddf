"""One message for a keyword that a constructor does not take.

Python's own ``TypeError: __init__() got an unexpected keyword argument 'x'`` says
neither whether ``x`` is an option of the library the code came from (kfac-pytorch,
DistributedShampoo) that secondorder does not offer, nor what was probably meant.
:func:`check_keywords` says both::

    check_keywords("KFAC", {"dampnig": 0.1}, valid=("damping", "lr"))
    # TypeError: KFAC got an unexpected keyword argument 'dampnig' (a typo?); did you
    # mean 'damping'?

A keyword found in ``known`` (the reference's option names, each with a hint) is named
as that library's option with the hint, e.g. the supported way to get the same effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping

__all__ = ["check_keywords", "unknown_keyword_error"]


def unknown_keyword_error(
    owner: str,
    keyword: str,
    valid: Iterable[str],
    known: Mapping[str, str] | None = None,
    reference: str = "",
) -> TypeError:
    """The error for one keyword ``owner`` does not take (returned, not raised).

    Args:
        owner: how the message names the callable, e.g. ``"so.KFAC"``.
        keyword: the keyword that was passed.
        valid: the keywords ``owner`` takes (the suggestion is chosen among them).
        known: option names of the reference library that ``owner`` does not take,
            each mapped to a hint (what to do instead; may be empty).
        reference: the reference library's name, e.g. ``"kfac-pytorch (KAISA)"``.
    """
    known = known or {}
    valid = sorted(valid)
    if keyword in known:
        where = f" {reference}" if reference else " the reference library"
        hint = known[keyword]
        return TypeError(
            f"{owner} does not support{where}'s option {keyword!r}" + (f": {hint}" if hint else ".")
        )
    close = difflib.get_close_matches(keyword, valid, n=1, cutoff=0.6)
    # a reference option with a nearer spelling than any valid one is the likelier intent
    near_known = difflib.get_close_matches(keyword, list(known), n=1, cutoff=0.75)
    if near_known and close and _ratio(keyword, near_known[0]) <= _ratio(keyword, close[0]):
        near_known = []
    if not close or near_known:
        if near_known:
            return TypeError(
                f"{owner} got an unexpected keyword argument {keyword!r}; it is not an option "
                f"here (did you mean {reference or 'the reference'}'s {near_known[0]!r}, "
                f"which is not supported: {known[near_known[0]] or 'no equivalent'})."
            )
        return TypeError(
            f"{owner} got an unexpected keyword argument {keyword!r}; valid keywords are "
            f"{', '.join(valid)}."
        )
    return TypeError(
        f"{owner} got an unexpected keyword argument {keyword!r} (a typo?); did you mean "
        f"{close[0]!r}?"
    )


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def check_keywords(
    owner: str,
    kwargs: Mapping[str, object],
    valid: Collection[str],
    known: Mapping[str, str] | None = None,
    reference: str = "",
) -> None:
    """Raise :func:`unknown_keyword_error`'s error for the first keyword not in ``valid``."""
    for keyword in kwargs:
        if keyword not in valid:
            raise unknown_keyword_error(owner, keyword, valid, known, reference)
