"""What celery/amqp_compat.py relies on in py-amqp, checked against the installed py-amqp
without a broker: the frames it writes and how py-amqp hands it what it reads. The claim
itself, on a real broker, is tests/celery/test_once.py's."""

from __future__ import annotations

from typing import Any

from amqp import spec
from amqp.serialization import dumps, loads

from amqp_locks.celery.amqp_compat import DECLARE_FORMAT, ClaimChannel, send_declare


class _Wire:
    """The part of ``amqp.Connection`` a channel uses: its channel table and frame writer
    (what the channel writes is recorded)."""

    confirm_publish = False

    def __init__(self) -> None:
        self.channels: dict[int, Any] = {}
        self._used_channel_ids: list[int] = []
        self.written: list[tuple[tuple[int, int], str]] = []

    def _claim_channel_id(self, channel_id: int) -> None:
        self._used_channel_ids.append(channel_id)

    def frame_writer(self, _type: int, _channel: int, sig: Any, args: Any, _content: Any) -> None:
        self.written.append((sig, args))


def test_a_declare_is_written_at_once_and_its_answer_read_by_anyone() -> None:
    wire = _Wire()
    channel = ClaimChannel(wire, channel_id=7)
    ok = send_declare(
        channel, "k.once", "fanout", durable=True, auto_delete=True, arguments={"a": "b"}
    )
    ((sig, raw),) = wire.written
    assert sig == spec.Exchange.Declare
    fields, _ = loads(DECLARE_FORMAT, raw.encode("latin-1") if isinstance(raw, str) else raw, 0)
    assert fields == [0, "k.once", "fanout", False, True, True, False, False, {"a": "b"}]
    assert not ok.ready
    # Whoever drains the connection dispatches declare-ok to the promise registered first.
    channel.dispatch_method(spec.Exchange.DeclareOk, b"", None)
    assert ok.ready


def test_a_refusal_is_recorded_answered_and_not_raised() -> None:
    wire = _Wire()
    channel = ClaimChannel(wire, channel_id=7)
    text = "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange'"
    # A method frame's payload: its class and method ids (4 bytes), then its arguments.
    payload = b"\0\0\0\0" + dumps("BsBB", (406, text, 40, 10))
    channel.dispatch_method(spec.Channel.Close, payload, None)  # raises with py-amqp's own
    assert channel.closed_with == (406, text)
    assert [sig for sig, _ in wire.written] == [spec.Channel.CloseOk]
    assert 7 not in wire.channels and channel.connection is None  # the id is free again
