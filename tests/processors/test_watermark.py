"""Watermarking (seed 001): the high-watermark rules, outgoing-to-incoming tracking with 1-to-many
and filtered messages, and the Acker. Pure bookkeeping: no server."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.processors import FILTERED, Acker, Watermarker


def marker(routes: dict[str, list[int]]) -> Watermarker:
    """A watermarker whose routes were sent the given ids (interleaved by id)."""
    w = Watermarker()
    for r in routes:
        w.add_route(r)
    for i, r in sorted((i, r) for r, ids in routes.items() for i in ids):
        w.sent(r, i)
    return w


# ---------------------------------------------------------------- the high-watermark rules


def test_single_route_watermark_is_the_highest_ack() -> None:
    w = marker({"B": [1, 2, 3]})
    assert w.propose_watermark() == 0
    w.ack_received("B", 2)
    assert w.propose_watermark() == 2
    w.ack_received("B", 3)
    assert w.propose_watermark() == 3


def test_the_seeds_example_foo_acked_5_bar_acked_2_gives_2() -> None:
    w = marker({"Foo": [1, 4, 5], "Bar": [2, 3, 6]})
    w.ack_received("Foo", 5)
    w.ack_received("Bar", 2)
    assert w.propose_watermark() == 2


def test_all_routes_fully_acked_gives_the_highest_across_routes() -> None:
    w = marker({"Foo": [1, 4, 5], "Bar": [2, 3, 6]})
    w.ack_received("Foo", 5)
    w.ack_received("Bar", 6)
    assert w.is_fully_acked()
    assert w.propose_watermark() == 6


def test_fully_acked_route_with_the_highest_id_does_not_lift_the_watermark() -> None:
    # Foo is done up to 7 but Bar still owes 3..6: only 2 is safe
    w = marker({"Foo": [1, 7], "Bar": [2, 3, 6]})
    w.ack_received("Foo", 7)
    w.ack_received("Bar", 2)
    assert w.propose_watermark() == 2


def test_lowest_ack_among_routes_not_fully_acked() -> None:
    w = marker({"Foo": [1, 5], "Bar": [2, 4, 8], "Baz": [3, 6, 7]})
    w.ack_received("Foo", 5)  # fully acked: not considered
    w.ack_received("Bar", 4)
    w.ack_received("Baz", 3)
    assert w.propose_watermark() == 3
    w.ack_received("Baz", 7)  # Baz fully acked now; Bar (4 of 8) is the only one left
    assert w.propose_watermark() == 4


def test_a_route_with_nothing_acked_holds_the_watermark_at_zero() -> None:
    w = marker({"Foo": [1, 2], "Bar": [3]})
    w.ack_received("Bar", 3)
    assert w.propose_watermark() == 0


def test_a_route_never_sent_anything_counts_as_fully_acked() -> None:
    w = marker({"Foo": [1, 2], "Idle": []})
    w.ack_received("Foo", 2)
    assert w.propose_watermark() == 2


def test_the_watermark_never_moves_backwards() -> None:
    w = marker({"Foo": [1, 4, 5], "Bar": [2, 3]})
    w.ack_received("Foo", 5)
    w.ack_received("Bar", 3)
    assert w.propose_watermark() == 5
    w.sent("Bar", 6)  # by the rule alone the value would drop to Bar's 3
    assert w.propose_watermark() == 5
    w.ack_received("Bar", 6)
    assert w.propose_watermark() == 6


def test_repeated_and_older_acks_change_nothing() -> None:
    w = marker({"B": [1, 2, 3]})
    w.ack_received("B", 2)
    w.ack_received("B", 1)
    w.ack_received("B", 2)
    assert w.propose_watermark() == 2


# ---------------------------------------------------------------- filtered messages


def test_filtered_messages_are_done_at_once() -> None:
    w = marker({"Foo": [1]})
    w.filtered(2)
    w.filtered(3)
    assert w.propose_watermark() == 0  # Foo still owes 1
    w.ack_received("Foo", 1)
    assert w.propose_watermark() == 3
    assert w.is_fully_acked(FILTERED)


def test_only_filtered_messages_give_the_highest_filtered_id() -> None:
    w = Watermarker()
    w.filtered(1)
    w.filtered(2)
    assert w.propose_watermark() == 2


# ---------------------------------------------------------------- misuse


def test_misuse_is_refused_with_clear_errors() -> None:
    w = marker({"Foo": [1, 3]})
    with pytest.raises(ValueError, match="only ids up to 3"):
        w.ack_received("Foo", 4)
    with pytest.raises(ValueError, match="increase across all routes"):
        w.sent("Foo", 3)
    with pytest.raises(ValueError, match="increase across all routes"):
        w.filtered(2)
    with pytest.raises(KeyError, match="add_route"):
        w.sent("Nope", 9)
    with pytest.raises(ValueError, match="unacknowledged"):
        w.remove_route("Foo")
    with pytest.raises(ValueError, match="filtered"):
        w.sent(FILTERED, 9)
    w.ack_received("Foo", 3)
    w.remove_route("Foo")
    assert w.routes == [FILTERED]


# ---------------------------------------------------------------- acker: tracking and acking upstream


def test_acker_acks_each_producer_only_its_highest_done_message() -> None:
    a = Acker()
    a.add_route("B")
    for o, (producer, i) in enumerate([("P", 1), ("Q", 1), ("P", 2), ("Q", 2), ("P", 3)], 1):
        a.sent("B", o, producer, i)
    a.ack_received("B", 4)
    assert a.acks_to_send() == {"P": 2, "Q": 2}
    assert a.acks_to_send() == {}  # nothing moved since
    a.ack_received("B", 5)
    assert a.acks_to_send() == {"P": 3}
    assert a.pending == 0


def test_acker_one_to_many_waits_for_the_last_output_of_a_message() -> None:
    a = Acker()
    a.add_route("Foo")
    a.add_route("Bar")
    # incoming 1 fans out to 1 (Foo), 2 (Bar) and 3 (Bar)
    a.sent("Foo", 1, "P", 1)
    a.sent("Bar", 2, "P", 1)
    a.sent("Bar", 3, "P", 1)
    a.ack_received("Foo", 1)
    a.ack_received("Bar", 2)
    assert a.watermarker.propose_watermark() == 2
    assert a.acks_to_send() == {}  # output 3 of message 1 is not done
    a.ack_received("Bar", 3)
    assert a.acks_to_send() == {"P": 1}
    a.sent("Foo", 4, "P", 2)
    a.ack_received("Foo", 4)
    assert a.acks_to_send() == {"P": 2}


def test_acker_filtered_message_between_sent_ones() -> None:
    a = Acker()
    a.add_route("B")
    a.sent("B", 1, "P", 1)
    a.filtered(2, "P", 2)
    a.sent("B", 3, "P", 3)
    assert a.acks_to_send() == {}
    a.ack_received("B", 1)
    # B still owes 3, so by the rule the watermark is B's ack (1): the filtered 2 waits
    assert a.acks_to_send() == {"P": 1}
    a.ack_received("B", 3)
    assert a.acks_to_send() == {"P": 3}


def test_acker_filtered_messages_after_everything_sent_are_acked_at_once() -> None:
    a = Acker()
    a.add_route("B")
    a.sent("B", 1, "P", 1)
    a.ack_received("B", 1)
    a.filtered(2, "P", 2)
    a.filtered(3, "Q", 1)
    assert a.acks_to_send() == {"P": 2, "Q": 1}


def test_acker_seed_example_acks_upstream_only_below_the_watermark() -> None:
    a = Acker()
    a.add_route("Foo")
    a.add_route("Bar")
    routes = {1: "Foo", 2: "Bar", 3: "Bar", 4: "Foo", 5: "Foo", 6: "Bar"}
    for o in range(1, 7):  # message i of producer P became outgoing i
        a.sent(routes[o], o, "P", o)
    a.ack_received("Foo", 5)
    a.ack_received("Bar", 2)
    assert a.acks_to_send() == {"P": 2}
    a.ack_received("Bar", 6)
    assert a.acks_to_send() == {"P": 6}


def test_acker_holds_back_the_message_being_emitted() -> None:
    """acks_to_send() between two sent() calls for one incoming message: inside emitting() it
    acknowledges the messages before, never the one whose outputs are not all sent yet."""
    a = Acker()
    a.add_route("B")
    a.sent("B", 1, "P", 1)
    a.ack_received("B", 1)
    with a.emitting("P", 2):
        a.sent("B", 2, "P", 2)
        a.ack_received("B", 2)  # downstream was quick: the first output of message 2 is done
        assert a.acks_to_send() == {"P": 1}
        a.sent("B", 3, "P", 2)
    assert a.acks_to_send() == {}  # output 3 is not done
    a.ack_received("B", 3)
    assert a.acks_to_send() == {"P": 2}
    with a.emitting("P", 3):
        a.filtered(4, "P", 3)
        assert a.acks_to_send() == {}
    assert a.acks_to_send() == {"P": 3}
    assert a.pending == 0


def test_acker_refuses_an_output_of_a_message_it_already_acknowledged() -> None:
    """Without emitting(), an early acks_to_send() acks message 1 after its first output; the
    second output then cannot be tracked honestly: refused, loudly."""
    a = Acker()
    a.add_route("B")
    a.sent("B", 1, "P", 1)
    a.ack_received("B", 1)
    assert a.acks_to_send() == {"P": 1}  # too early: message 1 has one more output
    with pytest.raises(ValueError, match="already acknowledged"):
        a.sent("B", 2, "P", 1)
    with pytest.raises(ValueError, match="already acknowledged"):
        a.filtered(2, "P", 1)
    with pytest.raises(ValueError, match="emitting"):
        with a.emitting("P", 5):
            with a.emitting("P", 6):
                pass
    a.sent("B", 2, "P", 2)  # the next message is fine
    a.ack_received("B", 2)
    assert a.acks_to_send() == {"P": 2}


def test_acker_numbers_outgoing_messages_when_asked() -> None:
    a = Acker()
    a.add_route("B")
    assert a.next_id() == 1
    a.sent("B", a.next_id(), "P", 1)
    a.filtered(a.next_id(), "P", 2)
    assert a.next_id() == 3


# ---------------------------------------------------------------- properties


Event = tuple[str, list[int]]


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """Random interleavings of: a message in, with 0..4 outputs each on a random route (several
    may share a route), and an ack on a route of its oldest unacked message."""
    message = st.tuples(st.just("in"), st.lists(st.integers(0, 2), max_size=4))
    ack = st.tuples(st.just("ack"), st.lists(st.integers(0, 2), min_size=1, max_size=1))
    return draw(st.lists(st.one_of(message, ack), max_size=80))


@settings(max_examples=400, deadline=None)
@given(histories())
def test_property_upstream_acks_never_pass_an_unfinished_message(history: list[Event]) -> None:
    routes = ["R0", "R1", "R2"]
    a = Acker()
    for r in routes:
        a.add_route(r)
    queues: dict[str, deque[int]] = {r: deque() for r in routes}
    owner: dict[int, int] = {}  # outgoing id -> incoming id
    acked_out: set[int] = set()
    incoming = 0
    for kind, picks in history:
        if kind == "in":
            incoming += 1
            if not picks:
                a.filtered(a.next_id(), "P", incoming)
                acked_out.add(a.watermarker.last_sent)
                owner[a.watermarker.last_sent] = incoming
            for k in picks:
                o = a.next_id()
                a.sent(routes[k], o, "P", incoming)
                queues[routes[k]].append(o)
                owner[o] = incoming
        else:
            r = routes[picks[0]]
            if queues[r]:
                o = queues[r].popleft()
                acked_out.add(o)
                a.ack_received(r, o)
        w = a.watermarker.propose_watermark()
        assert all(o in acked_out for o in range(1, w + 1)), "the watermark passed an unacked message"
        for i in a.acks_to_send().values():
            undone = {inc for o, inc in owner.items() if o not in acked_out}
            assert not any(j in undone for j in range(1, i + 1)), "acked upstream past an unfinished message"
    for r in routes:  # drain: then everything is acknowledged upstream
        while queues[r]:
            a.ack_received(r, queues[r].popleft())
    final = a.acks_to_send()
    assert a.pending == 0
    if incoming:
        assert a.watermarker.propose_watermark() == a.watermarker.last_sent
        assert final.get("P", 0) <= incoming
