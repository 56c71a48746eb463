"""The error root, the refusal vocabulary and its one answer table, the checked TxnStatus moves."""

from __future__ import annotations

import inspect
import pkgutil

import pytest

import onceflow
from onceflow.core.refusal import Refusal, Refused
from onceflow.core.txn import TxnError, TxnMeta, TxnStatus
from onceflow.errors import OnceflowError
from onceflow.server.answers import ANSWERS, SUCCESS


def test_every_refusal_has_an_answer() -> None:
    assert set(ANSWERS) == set(Refusal)
    for refusal in Refusal:
        answer = ANSWERS[refusal]
        assert 400 <= answer.status < 600, refusal
        assert answer.code, refusal
        if answer.retry_after:
            assert refusal.retriable, refusal


def test_success_kinds_are_successes() -> None:
    assert all(200 <= status < 300 for status in SUCCESS.values())


def test_retriable_refusals_answer_as_retriable() -> None:
    # the clients retry 5xx and 429: a retriable refusal must answer with one, and only they do
    for refusal in Refusal:
        status = ANSWERS[refusal].status
        assert refusal.retriable == (status >= 500 or status == 429), refusal


def test_refused_carries_its_refusal() -> None:
    err = Refused(Refusal.UNAVAILABLE, "later", txn=3)
    assert isinstance(err, OnceflowError) and err.retriable and err.code == "unavailable" and err.extra == {"txn": 3}
    assert not Refused(Refusal.FENCED, "no").retriable


def _public_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    skip = (
        "onceflow.bench",
        "onceflow.chaos",
        "onceflow.sim",
        "onceflow.faultproxy",
        "onceflow.tools",
        "onceflow.spark.datasource",
    )
    for mod in pkgutil.walk_packages(onceflow.__path__, "onceflow."):
        if mod.name.startswith(skip):
            continue
        try:
            module = __import__(mod.name, fromlist=["_"])
        except ImportError:  # an optional dependency (pyspark, psycopg, redis) is missing
            continue
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and not name.startswith("_")
                and obj.__module__.startswith("onceflow.")
            ):
                found[f"{obj.__module__}.{name}"] = obj
    return list(found.values())


def test_every_public_exception_descends_from_the_root() -> None:
    classes = _public_exceptions()
    assert len(classes) > 20
    outside = [c.__qualname__ for c in classes if not issubclass(c, OnceflowError)]
    assert outside == []


def test_value_errors_stay_value_errors() -> None:
    from onceflow.core.jsonmode import JsonError
    from onceflow.server.guard import GuardConfigError
    from onceflow.spark.options import OptionError

    for cls in (OptionError, JsonError, GuardConfigError):
        assert issubclass(cls, ValueError) and issubclass(cls, OnceflowError)


def test_an_illegal_transition_is_refused_before_anything_is_written() -> None:
    meta = TxnMeta("t", epoch=0)
    with pytest.raises(TxnError, match="cannot go from empty to complete_commit"):
        meta.check_move(TxnStatus.COMPLETE_COMMIT)
    meta.check_move(TxnStatus.ONGOING)
    meta = TxnMeta("t", epoch=0, status=TxnStatus.PREPARE_COMMIT)
    with pytest.raises(TxnError, match="cannot go from prepare_commit to ongoing"):
        meta.check_move(TxnStatus.ONGOING)
    assert meta.status is TxnStatus.PREPARE_COMMIT


def test_every_transition_in_the_table_is_allowed_and_no_other() -> None:
    for old in TxnStatus:
        for new in TxnStatus:
            meta = TxnMeta("t", status=old)
            if old.can_become(new):
                meta.check_move(new)
            else:
                with pytest.raises(TxnError) as refused:
                    meta.check_move(new)
                assert refused.value.kind is Refusal.INVALID_STATE
            assert meta.status is old


def test_status_changes_only_where_a_record_is_applied() -> None:
    """A transactional id's state changes in one place, :meth:`Coordinator._apply_txn`, in replay
    and live alike (issue 29); the only other change is taking back a move whose record never
    reached the log (``_take_back``, which sets the fields it is given)."""
    import onceflow.core.txn as txn

    source = inspect.getsource(txn)
    body = inspect.getsource(txn.Transactions._apply_txn)
    assignments = [line.strip() for line in source.splitlines() if ".status = " in line or ".status, " in line]
    assert assignments and assignments == [
        line.strip() for line in body.splitlines() if ".status = " in line or ".status, " in line
    ]
