"""`runtime.openai_api.parse`: parameters we do not implement are refused by name unless they
hold their harmless value, compared with its type (JSON true is not 1, 0 is not false)."""

from __future__ import annotations

import pytest
from layersplit.runtime.openai_api import RequestError, parse

MODEL = "m"


def _completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}


@pytest.mark.parametrize("field,value", [("best_of", 1), ("best_of", None), ("store", False),
                                         ("min_p", 0), ("min_p", 0.0), ("suffix", ""),
                                         ("skip_special_tokens", True)])
def test_harmless_values_pass(field, value):
    parse(_completion(**{field: value}), "completion", MODEL)


@pytest.mark.parametrize("field,value", [("best_of", True), ("best_of", 2), ("store", 0),
                                         ("store", True), ("min_p", False), ("suffix", "x"),
                                         ("skip_special_tokens", 1),
                                         ("include_stop_str_in_output", 0)])
def test_other_values_are_refused_by_name(field, value):
    with pytest.raises(RequestError, match=f"'{field}'=.* is not supported") as e:
        parse(_completion(**{field: value}), "completion", MODEL)
    assert e.value.param == field
