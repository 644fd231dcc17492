"""What the once claim needs from py-amqp (kombu's ``pyamqp`` transport) beyond its
documented API, in one place (as transport/ does for the locks' own AMQP client).

A claim sent on the producer's own connection (celery/once.py, :func:`claim_on`) must be
on the socket before Celery builds the message, and its answer read after: one round
trip that overlaps Celery's work. No public py-amqp hook does this.
``Channel.exchange_declare`` with ``nowait=False`` sends and reads the answer in one call
(Celery waits for it); with ``nowait=True`` the broker sends no answer, so acceptance
shows only by a later method's answer: a round trip more when the answer is asked for
(a nowait declare and a passive one cost 0.42-0.45 ms p50 here, RabbitMQ 3.10.8 on
loopback, 400 claims twice; ours 0.49 ms in all, overlapped). And a refusal closes the
channel, which py-amqp raises in whichever call reads the connection next (Celery's own
queue declare) unless the channel's close handler is replaced. So three needs go
further, each relied on here only:

* **Send now, read later** (:func:`send_declare`): ``AbstractChannel.send_method(sig,
  format, args)`` with the argument format of ``exchange.declare`` (``"BssbbbbbF"``, as
  ``Channel.exchange_declare`` passes it), and a promise registered in
  ``AbstractChannel._pending`` under ``Exchange.DeclareOk`` *before* the send: whoever
  reads the connection first (Celery declaring its queue on another channel, or our
  reader) hands the answer to it; one registered later would miss an answer already read.
* **A refusal recorded, not raised** (:class:`ClaimChannel`): py-amqp binds
  ``Channel._on_close(reply_code, reply_text, class_id, method_id)`` as the handler of
  ``channel.close`` when a channel is made, and raises the close in whichever call reads
  it. The override records it, answers ``channel.close-ok`` and frees the channel
  (``collect``), as py-amqp's own handler does before raising.
* **The producer's py-amqp connection** (:func:`producer_connection`): kombu's
  ``Connection.transport_cls`` and its ``connection`` (py-amqp's ``amqp.Connection``).

tests/celery/test_amqp_compat.py checks each against the installed py-amqp.
"""

from __future__ import annotations

from typing import Any

import amqp
from amqp import spec
from vine import promise

#: kombu transports whose connection is a py-amqp ``amqp.Connection``.
PY_AMQP_TRANSPORTS = ("amqp", "pyamqp", "amqps")

#: ``exchange.declare``'s argument format in py-amqp (``Channel.exchange_declare``'s
#: ``argsig``): ticket, exchange, type, passive, durable, auto_delete, internal, nowait,
#: arguments.
DECLARE_FORMAT = "BssbbbbbF"


def producer_connection(producer: Any) -> amqp.Connection | None:
    """The kombu `producer`'s py-amqp connection, connected (it connects if it is not
    yet), or None (another transport)."""
    connection: Any = getattr(producer, "connection", None)
    if getattr(connection, "transport_cls", None) not in PY_AMQP_TRANSPORTS:
        return None
    raw = connection.connection  # connects if it is not yet
    return raw if isinstance(raw, amqp.Connection) and raw.connected else None


class ClaimChannel(amqp.Channel):
    """A channel of a producer's py-amqp connection for claims. Its close (a refused
    claim) is recorded in :attr:`closed_with`, not raised: Celery may read the connection
    (a queue declare of its own) before the claim's answer is asked for, and py-amqp
    raises a channel's close in whichever call reads it."""

    closed_with: tuple[int, str] | None = None

    def _on_close(self, reply_code: int, reply_text: str, *_: Any) -> None:
        self.closed_with = (reply_code, reply_text)
        self.send_method(spec.Channel.CloseOk)
        self.collect()


def open_claim_channel(raw: amqp.Connection) -> ClaimChannel:
    """A new :class:`ClaimChannel` on `raw`, open (one round trip)."""
    channel = ClaimChannel(raw)
    channel.open()
    return channel


def send_declare(
    channel: ClaimChannel,
    exchange: str,
    exchange_type: str,
    *,
    durable: bool,
    auto_delete: bool,
    arguments: dict[str, Any],
) -> promise:
    """Send ``exchange.declare`` on `channel` without reading its answer; the returned
    promise is ready (``.ready``) once declare-ok is read, by whichever caller reads the
    connection (``drain_events``). A refusal closes the channel instead
    (:attr:`ClaimChannel.closed_with`)."""
    ok = promise()
    # Before the send (module doc); py-amqp's stubs leave the attribute out.
    channel._pending[spec.Exchange.DeclareOk] = ok  # type: ignore[attr-defined]
    channel.send_method(
        spec.Exchange.Declare,
        DECLARE_FORMAT,
        (0, exchange, exchange_type, False, durable, auto_delete, False, False, arguments),
    )
    return ok
