"""Wallaroo-style watermarking: which messages a step may acknowledge to its upstream producers.

Vocabulary (seed 001):

- A **route** is the link from one step to one downstream consumer. Every message a step sends
  gets an *outgoing id*, strictly increasing across all of the step's routes. Acks on a route are
  cumulative and arrive in order (the consumer handles a route's messages first in, first out), so
  an ack of ``n`` on a route means every message sent on that route up to ``n`` is done.
- The **filtered route** holds the messages that entered the step and produced no output; they are
  done the moment they are filtered.
- The **high watermark** is an outgoing id such that every message the step sent with that id or
  a lower one is done. :class:`Watermarker` proposes it by the seed's rules.
- The **outgoing-to-incoming tracker** remembers which incoming message (producer, incoming id)
  each outgoing id came from; one incoming message may produce many outgoing ones.
- The :class:`Acker` ties both together: given the watermark it returns, per upstream producer,
  the highest incoming id that may be acknowledged.

Everything here is pure bookkeeping (no I/O, no clocks, not thread-safe): call it from one thread
or one event loop.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

__all__ = ["Acker", "FILTERED", "Watermarker"]


class _FilteredRoute:
    """The marker for the filtered-on-step route (its ``repr`` shows up in errors and tests)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FILTERED"


FILTERED: Hashable = _FilteredRoute()
"""The route of messages a step filtered out; :meth:`Watermarker.filtered` records them."""


class _AckedOnRoute:
    """One route's state: the highest id sent on it and the highest id it acknowledged."""

    __slots__ = ("highest_acked", "highest_sent")

    def __init__(self) -> None:
        self.highest_sent = 0
        self.highest_acked = 0

    @property
    def fully_acked(self) -> bool:
        return self.highest_acked == self.highest_sent


class Watermarker:
    """Per-route acknowledgement state of one step, and the high watermark it proposes.

    Ids are positive integers; 0 means "nothing". Rules of :meth:`propose_watermark` (seed 001):

    1. If every route is fully acknowledged (its highest ack is its highest sent id), the high
       watermark is the highest id across all routes.
    2. Otherwise it is the lowest acknowledged id among the routes that are not fully acknowledged.

    A proposal never moves backwards: once every id up to ``w`` is done, it stays done, so a later
    proposal is the maximum of the rule's value and the previous proposal.
    """

    def __init__(self) -> None:
        self._routes: dict[Hashable, _AckedOnRoute] = {FILTERED: _AckedOnRoute()}
        self._last_sent = 0
        self._proposed = 0

    def __repr__(self) -> str:
        routes = ", ".join(f"{r!r}: {s.highest_acked}/{s.highest_sent}" for r, s in self._routes.items())
        return f"Watermarker({routes}; proposed {self._proposed})"

    @property
    def routes(self) -> list[Hashable]:
        """The routes, the filtered route first."""
        return list(self._routes)

    @property
    def last_sent(self) -> int:
        """The highest outgoing id sent (or filtered) so far."""
        return self._last_sent

    def add_route(self, route: Hashable) -> None:
        """Register ``route`` (idempotent)."""
        self._routes.setdefault(route, _AckedOnRoute())

    def remove_route(self, route: Hashable) -> None:
        """Forget ``route``. Only a fully acknowledged route may go: its unacknowledged messages
        would otherwise count as done."""
        state = self._route(route)
        if route is FILTERED:
            raise ValueError("the filtered route belongs to every watermarker and cannot be removed")
        if not state.fully_acked:
            raise ValueError(
                f"route {route!r} still has unacknowledged messages "
                f"(sent up to {state.highest_sent}, acked up to {state.highest_acked})"
            )
        del self._routes[route]

    def _route(self, route: Hashable) -> _AckedOnRoute:
        try:
            return self._routes[route]
        except KeyError:
            raise KeyError(f"unknown route {route!r}; add_route() it first") from None

    def _next(self, outgoing_id: int) -> None:
        if not isinstance(outgoing_id, int) or outgoing_id <= self._last_sent:
            raise ValueError(
                f"outgoing ids must be integers that increase across all routes: "
                f"got {outgoing_id!r} after {self._last_sent}"
            )
        self._last_sent = outgoing_id

    def sent(self, route: Hashable, outgoing_id: int) -> None:
        """Record that ``outgoing_id`` was sent on ``route``."""
        state = self._route(route)
        if route is FILTERED:
            raise ValueError("use filtered() for messages that produced no output")
        self._next(outgoing_id)
        state.highest_sent = outgoing_id

    def filtered(self, outgoing_id: int) -> None:
        """Record that the message given ``outgoing_id`` produced no output: it is done at once."""
        self._next(outgoing_id)
        state = self._routes[FILTERED]
        state.highest_sent = state.highest_acked = outgoing_id

    def ack_received(self, route: Hashable, outgoing_id: int) -> None:
        """``route`` acknowledged every message sent on it up to ``outgoing_id``.

        A repeated or older ack changes nothing. Acknowledging an id the route was never sent up
        to is a bug in the caller and raises ``ValueError``.
        """
        state = self._route(route)
        if outgoing_id > state.highest_sent:
            raise ValueError(
                f"route {route!r} acknowledged {outgoing_id}, but only ids up to {state.highest_sent} were sent on it"
            )
        if outgoing_id > state.highest_acked:
            state.highest_acked = outgoing_id

    def is_fully_acked(self, route: Hashable | None = None) -> bool:
        """Whether ``route`` (or, without one, every route) has acknowledged all it was sent."""
        if route is not None:
            return self._route(route).fully_acked
        return all(s.fully_acked for s in self._routes.values())

    def propose_watermark(self) -> int:
        """The high watermark: every outgoing id up to it is done (see the class docstring)."""
        pending = [s.highest_acked for s in self._routes.values() if not s.fully_acked]
        if pending:
            value = min(pending)
        else:
            value = max(s.highest_sent for s in self._routes.values())
        if value > self._proposed:
            self._proposed = value
        return self._proposed


@dataclass(frozen=True, slots=True)
class _Sent:
    outgoing_id: int
    producer: Hashable
    incoming_id: int


class _OutgoingToIncomingMessageTracker:
    """Which incoming message each outgoing id came from, in outgoing order.

    One incoming message may produce many outgoing ones ("1 to many"); they must be tracked
    together, before any later incoming message's, which a step that handles one message at a time
    does naturally. An incoming message can be acknowledged once the watermark has reached the
    highest outgoing id it produced.
    """

    def __init__(self) -> None:
        self._sent: deque[_Sent] = deque()

    def __len__(self) -> int:
        return len(self._sent)

    def track(self, outgoing_id: int, producer: Hashable, incoming_id: int) -> None:
        if self._sent and outgoing_id <= self._sent[-1].outgoing_id:
            raise ValueError(f"outgoing id {outgoing_id} tracked after {self._sent[-1].outgoing_id}")
        self._sent.append(_Sent(outgoing_id, producer, incoming_id))

    def acked_up_to(self, watermark: int, hold: tuple[Hashable, int] | None = None) -> dict[Hashable, int]:
        """Forget what the watermark covers; return per producer the highest incoming id whose
        outgoing messages are all at or below ``watermark``. ``hold`` (producer, incoming id): a
        message whose outputs are still being tracked; it and everything after it stay."""
        acks: dict[Hashable, int] = {}
        sent = self._sent
        while sent and sent[0].outgoing_id <= watermark:
            if hold is not None and (sent[0].producer, sent[0].incoming_id) == hold:
                break
            entry = sent.popleft()
            if sent and sent[0].producer == entry.producer and sent[0].incoming_id == entry.incoming_id:
                continue  # the same message has a later output: that entry decides (now or later)
            acks[entry.producer] = entry.incoming_id
        return acks


class Acker:
    """Acknowledgement bookkeeping of one step: a :class:`Watermarker` and the tracker from
    outgoing to incoming messages.

    The step calls :meth:`sent` for every output (several per incoming message for "1 to many"),
    :meth:`filtered` for an incoming message that produced nothing, and :meth:`ack_received` when a
    downstream route acknowledges. :meth:`acks_to_send` returns what may now be acknowledged
    upstream: per producer the highest incoming id all of whose outputs are done, only when it
    moved since the last call. Incoming ids of one producer must increase.

    Contract for "1 to many": the Acker knows a message's outputs only as they are sent, so
    :meth:`acks_to_send` called between two :meth:`sent` calls for one incoming message would see
    its first outputs done and acknowledge it before the rest exist. Either send all of a
    message's outputs before calling :meth:`acks_to_send` (as ``Pipeline`` does), or send them
    inside ``with acker.emitting(producer, incoming_id):``, during which :meth:`acks_to_send`
    holds that message back (earlier ones are still acknowledged). An output of a message that was
    already acknowledged is refused (``ValueError``), so a violation is loud, not a silent early
    acknowledgement of everything after it.
    """

    def __init__(self) -> None:
        self.watermarker = Watermarker()
        self._tracker = _OutgoingToIncomingMessageTracker()
        self._acked: dict[Hashable, int] = {}
        self._next_id = 1
        self._emitting: tuple[Hashable, int] | None = None

    def __repr__(self) -> str:
        return f"Acker({self.watermarker!r}, {len(self._tracker)} tracked)"

    @property
    def pending(self) -> int:
        """Outgoing messages not yet covered by an acknowledgement sent upstream."""
        return len(self._tracker)

    def add_route(self, route: Hashable) -> None:
        self.watermarker.add_route(route)

    def next_id(self) -> int:
        """The next unused outgoing id (for steps that let the Acker number their messages)."""
        return max(self._next_id, self.watermarker.last_sent + 1)

    @contextlib.contextmanager
    def emitting(self, producer: Hashable, incoming_id: int) -> Iterator[None]:
        """Send the outputs of ``producer``'s message ``incoming_id`` inside this block: until it
        ends, :meth:`acks_to_send` does not acknowledge that message. One message at a time; every
        :meth:`sent` / :meth:`filtered` inside must be for it."""
        if self._emitting is not None:
            raise ValueError(
                f"already emitting message {self._emitting[1]} of {self._emitting[0]!r}; "
                "emitting() handles one incoming message at a time"
            )
        self._check_open(producer, incoming_id)
        self._emitting = (producer, incoming_id)
        try:
            yield
        finally:
            self._emitting = None

    def _check_open(self, producer: Hashable, incoming_id: int) -> None:
        acked = self._acked.get(producer, 0)
        if incoming_id <= acked:
            raise ValueError(
                f"message {incoming_id} of {producer!r} was already acknowledged upstream (up to {acked}): "
                "acks_to_send() ran between two of its outputs (send them inside emitting()), "
                "or the incoming ids of one producer did not increase"
            )
        if self._emitting is not None and self._emitting != (producer, incoming_id):
            raise ValueError(
                f"an output of message {incoming_id} of {producer!r} inside emitting() for message "
                f"{self._emitting[1]} of {self._emitting[0]!r}"
            )

    def sent(self, route: Hashable, outgoing_id: int, producer: Hashable, incoming_id: int) -> None:
        """``outgoing_id`` went out on ``route`` as (one of) the output(s) of ``producer``'s
        message ``incoming_id``. Refused (``ValueError``, nothing recorded) if that message was
        already acknowledged upstream."""
        self._check_open(producer, incoming_id)
        self.watermarker.sent(route, outgoing_id)
        self._tracker.track(outgoing_id, producer, incoming_id)
        self._next_id = outgoing_id + 1

    def filtered(self, outgoing_id: int, producer: Hashable, incoming_id: int) -> None:
        """``producer``'s message ``incoming_id`` produced no output; it is given ``outgoing_id``
        on the filtered route so the watermark can pass it."""
        self._check_open(producer, incoming_id)
        self.watermarker.filtered(outgoing_id)
        self._tracker.track(outgoing_id, producer, incoming_id)
        self._next_id = outgoing_id + 1

    def ack_received(self, route: Hashable, outgoing_id: int) -> None:
        self.watermarker.ack_received(route, outgoing_id)

    def acks_to_send(self) -> dict[Hashable, int]:
        """Per upstream producer, the highest incoming id that is now done (only those that moved).

        Call it only when every output of the messages it may acknowledge has been sent: not
        between two :meth:`sent` calls for one incoming message, unless they are inside
        :meth:`emitting` (which holds that message back); see the class docstring."""
        new: dict[Hashable, int] = {}
        watermark = self.watermarker.propose_watermark()
        for producer, incoming_id in self._tracker.acked_up_to(watermark, self._emitting).items():
            if incoming_id > self._acked.get(producer, 0):
                self._acked[producer] = new[producer] = incoming_id
        return new
