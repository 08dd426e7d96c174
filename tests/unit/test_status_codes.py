# SPDX-License-Identifier: Apache-2.0
"""src/core/status.h is the only list of the native status codes; every code in it maps
to its own exception class in mooncake_te.errors, with that ``.status``, across pickling."""
import pathlib
import pickle
import re

import pytest

from mooncake_te import errors as E
from mooncake_te.batch import error_for

STATUS_H = pathlib.Path(__file__).resolve().parents[2] / "src" / "core" / "status.h"
DEFINE = re.compile(r"^#define (MTE_E_\w+)\s+\((-?\d+)\)", re.M)


def _codes():
    """{name: code} of status.h, and its ranges {name: (base, span)}."""
    found = dict((n, int(v)) for n, v in DEFINE.findall(STATUS_H.read_text()))
    ranges = {n[:-5]: (v, found[n[:-5] + "_SPAN"]) for n, v in found.items()
              if n.endswith("_BASE")}
    codes = {n: v for n, v in found.items() if not n.endswith(("_BASE", "_SPAN"))}
    return codes, ranges


def test_status_h_is_parsed():
    codes, ranges = _codes()
    assert codes["MTE_E_PEER_RESTARTED"] == -1006 and codes["MTE_E_CLOSED"] == -1008
    assert set(ranges) == {"MTE_E_RDMA_WC", "MTE_E_STORAGE"}


def test_no_code_is_listed_twice():
    codes, _ = _codes()
    assert len(set(codes.values())) == len(codes), codes


@pytest.mark.parametrize("name,code", sorted(_codes()[0].items()))
def test_every_code_has_its_own_class(name, code):
    cls = E.error_class(code)
    assert cls is not E.TransferError or code == E.ERR_TRANSFER_FAIL, name
    assert cls.default_status == code, (name, cls)
    # No other code of status.h maps to the same class.
    others = [n for n, c in _codes()[0].items() if c != code and E.error_class(c) is cls]
    assert not others, (name, others)
    e = error_for(code, "peer", 0, 1, 0x1000, 0x2000, 64)
    assert type(e) is cls and e.status == code
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and back.status == code and str(back) == str(e)


@pytest.mark.parametrize("name", ["MTE_E_RDMA_WC", "MTE_E_STORAGE"])
def test_ranges_have_one_class(name):
    base, span = _codes()[1][name]
    first = E.error_class(base - 1)
    assert issubclass(first, E.TransferError)
    for code in (base - 1, base - 5, base - 12, base - span + 1):
        cls = E.error_class(code)
        assert issubclass(cls, first) or cls is first, code
        e = error_for(code, "peer", 0, 2, 0, 0, 8)
        assert e.status == code and isinstance(e, first)
        assert pickle.loads(pickle.dumps(e)).status == code


def test_a_second_class_for_a_code_is_rejected():
    with pytest.raises(TypeError, match="already belongs to PeerRestartedError"):
        class Again(E.TransferError, status=-1006):    # noqa: F841
            pass
    with pytest.raises(TypeError, match="overlap"):
        class Inside(E.TransferError, status_range=(-1410, -1420)):    # noqa: F841
            pass


def test_closed_error_is_what_closed_objects_raised_before():
    e = E.ClosedError("the thing is closed")
    assert isinstance(e, E.MooncakeError) and isinstance(e, E.TransferError)
    assert isinstance(e, ValueError) and isinstance(e, RuntimeError)
    assert isinstance(e, E.InvalidArgumentError) and e.status == E.ERR_CLOSED


def test_verbs_error_is_a_mooncake_error_and_an_os_error():
    e = E.VerbsError(5, "ibv_reg_mr: Input/output error")
    assert isinstance(e, E.MooncakeError) and isinstance(e, OSError)
    assert e.errno == 5 and "ibv_reg_mr" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is E.VerbsError and back.errno == 5 and back.status == e.status
