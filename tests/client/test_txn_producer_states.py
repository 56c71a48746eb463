"""The transactional producer's states (issue 29, item 4): one field, changed by one method along
one table (``_MOVES``), as the server's ``TxnStatus`` is; each call that writes or commits checks
the state in one place (``_check_open``) and answers with the errors it always did."""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.txn import committed, make
from onceflow.client import (
    AbortRequiredError,
    CommitOutcomeUnknownError,
    OnceflowError,
    OutcomeUnknownError,
    ProducerFencedError,
    transactions,
)
from onceflow.client.transactions import _MOVES, AsyncTransactionalProducer, TxnProducerState, _Commit

S = TxnProducerState
BASE = "http://testserver"
FENCE = ProducerFencedError("fenced", status=403, code="stale_epoch")
LOST = OutcomeUnknownError("no answer", code="outcome_unknown")
COMMIT = _Commit(7, BASE + "/v1/txn/t/commit", b"{}", {})


def payload(state: TxnProducerState) -> dict[str, Any]:
    """What ``_move`` takes with each state."""
    if state is S.FENCED:
        return {"failure": FENCE}
    if state in (S.ABORT_REQUIRED, S.ABORT_BY_NEW_EPOCH):
        return {"failure": LOST}
    if state is S.COMMIT_UNKNOWN:
        return {"commit": COMMIT}
    return {}


@pytest.fixture
async def idle() -> AsyncIterator[AsyncTransactionalProducer]:
    """A producer that sends nothing (its states are set by hand)."""
    async with httpx.AsyncClient(base_url=BASE) as client:
        yield AsyncTransactionalProducer(BASE, "t", client=client)


@pytest.mark.anyio
async def test_every_move_in_the_table_is_allowed_and_no_other(idle: AsyncTransactionalProducer) -> None:
    assert set(_MOVES) == set(S)
    for old in S:
        for new in S:
            idle._state, idle._failure, idle._commit = old, None, None
            if old.can_become(new):
                idle._move(new, **payload(new))
                assert idle.state is new
            else:
                with pytest.raises(AssertionError, match=f"no move from {old.value} to {new.value}"):
                    idle._move(new, **payload(new))
                assert idle.state is old


@pytest.mark.anyio
async def test_a_move_without_what_its_state_holds_is_refused(idle: AsyncTransactionalProducer) -> None:
    idle._move(S.READY)
    idle._move(S.IN_TXN)
    with pytest.raises(AssertionError):
        idle._move(S.ABORT_REQUIRED)  # which write failed?
    with pytest.raises(AssertionError):
        idle._move(S.COMMIT_UNKNOWN)  # which commit to send again?
    with pytest.raises(AssertionError):
        idle._move(S.READY, failure=LOST)
    assert idle.state is S.IN_TXN


def test_every_state_is_reached_from_a_new_producer_and_every_one_leads_back_to_ready() -> None:
    seen, todo = {S.UNINITIALISED}, [S.UNINITIALISED]
    while todo:
        for new in _MOVES[todo.pop()] - seen:
            seen.add(new)
            todo.append(new)
    assert seen == set(S)
    assert all(S.READY in moves for moves in _MOVES.values())  # init() or resume()
    assert all(S.FENCED in moves for moves in _MOVES.values())  # a 403


def test_the_state_changes_only_in_move() -> None:
    """One field holds the state, and one method sets it with what the state holds (issue 29,
    item 4): every other assignment to them is the constructor's."""
    source = inspect.getsource(transactions)
    targets = [line.strip().partition(" = ")[0] for line in source.splitlines() if " = " in line]
    assigned = [t for t in targets if re.search(r"\bself\._(state|failure|commit)\b", t)]
    assert assigned == [
        "self._state",
        "self._failure: BaseException | None",
        "self._commit: _Commit | None",
        "self._state, self._failure, self._commit",
    ]
    assert "self._state, self._failure, self._commit = " in inspect.getsource(AsyncTransactionalProducer._move)


@pytest.mark.anyio
async def test_each_state_refuses_writes_with_the_error_it_always_did(idle: AsyncTransactionalProducer) -> None:
    for state in S:
        idle._state, idle._failure, idle._commit = state, None, None
        for name, value in payload(state).items():
            setattr(idle, "_" + name, value)
        if state in (S.READY, S.IN_TXN):
            idle._check_open()
            continue
        with pytest.raises(OnceflowError) as refused:
            await idle.append("s", {"n": 1})
        err = refused.value
        if state is S.UNINITIALISED:
            assert type(err) is OnceflowError and err.message == "init() the transactional producer first"
        elif state is S.FENCED:
            assert err is FENCE and idle.fenced
        elif state is S.COMMIT_UNKNOWN:
            assert isinstance(err, CommitOutcomeUnknownError)
            assert (err.code, err.txn) == ("commit_outcome_unknown", 7)
            with pytest.raises(CommitOutcomeUnknownError):
                await idle.abort()  # refused too
        else:
            assert isinstance(err, AbortRequiredError)
            assert (err.code, err.cause) == ("abort_required", LOST)
            assert idle._owes_abort()
        assert idle.state is state


@pytest.mark.anyio
async def test_the_states_of_a_producers_life(onceflow: InProcess) -> None:
    await make(onceflow, "a")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=onceflow.app), base_url=BASE) as client:
        producer = AsyncTransactionalProducer(BASE, "t", client=client)
        assert producer.state is S.UNINITIALISED
        await producer.abort()  # nothing to abort
        assert producer.state is S.UNINITIALISED
        await producer.init()
        assert producer.state is S.READY
        await producer.append("a", {"n": 1})
        assert producer.state is S.IN_TXN
        await producer.commit()
        assert producer.state is S.READY
        await producer.append("a", {"n": 2})
        await producer.flush()
        await producer.abort()
        assert producer.state is S.READY
        await producer.commit()  # nothing to commit
        assert producer.state is S.READY

        newer = AsyncTransactionalProducer(BASE, "t", client=client)
        await producer.append("a", {"n": 3})
        await newer.init()
        with pytest.raises(ProducerFencedError):
            await producer.flush()
        assert producer.state is S.FENCED and producer.fenced
        await producer.abort()  # drops the buffers, the newer epoch aborted the rest
        assert producer.state is S.FENCED
        await producer.init()  # takes the id back
        assert producer.state is S.READY
        async with producer.transaction():
            await producer.append("a", {"n": 4})
        assert producer.state is S.READY
    assert await committed(onceflow, "a") == [{"n": 1}, {"n": 4}]


@pytest.mark.anyio
async def test_a_closed_producer_says_so_instead_of_an_unknown_commit(server: Any) -> None:
    """Found by the review of the states: a producer whose own HTTP client was closed sent its
    next request through the closed client, and a commit then ended in COMMIT_UNKNOWN ("call
    commit() again", which could never succeed). Every call after close() is refused, saying it is
    closed, before anything is sent."""
    httpx.put(f"{server.url}/v1/stream/a", headers={"content-type": "application/json"}).raise_for_status()
    producer = AsyncTransactionalProducer(server.url, "t")
    await producer.init()
    await producer.append("a", {"n": 1})
    await producer.close()
    for call in (producer.commit, producer.flush, producer.abort, producer.init):
        with pytest.raises(OnceflowError, match="closed") as refused:
            await call()
        assert refused.value.code == "closed" and not isinstance(refused.value, OutcomeUnknownError)
    assert producer.state is not S.COMMIT_UNKNOWN
