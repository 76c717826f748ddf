from __future__ import annotations

import pytest

from secondorder._keywords import check_keywords, unknown_keyword_error


def test_a_typo_gets_the_closest_valid_name():
    with pytest.raises(
        TypeError,
        match=r"^KFAC got an unexpected keyword argument 'dampnig' \(a typo\?\); "
        r"did you mean 'damping'\?$",
    ):
        check_keywords("KFAC", {"dampnig": 1}, ("damping", "lr"))


def test_a_reference_option_gets_its_hint():
    err = unknown_keyword_error(
        "KFAC", "tdc", ("damping",), {"tdc": "pass nothing."}, "kfac-pytorch"
    )
    assert str(err) == "KFAC does not support kfac-pytorch's option 'tdc': pass nothing."


def test_no_close_name_lists_the_valid_ones():
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'zzz'; valid keywords are damping, lr\.$"
    ):
        check_keywords("KFAC", {"zzz": 1}, ("lr", "damping"))


def test_a_misspelt_reference_option_is_named_as_unsupported():
    err = unknown_keyword_error("S", "momentun", ("lr",), {"momentum": "use X."}, "DS")
    assert "did you mean DS's 'momentum', which is not supported: use X." in str(err)


def test_valid_keywords_pass():
    check_keywords("KFAC", {"lr": 1}, ("lr",))
