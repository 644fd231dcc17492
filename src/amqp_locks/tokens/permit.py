"""The holder's side: a token delivered to us and left unacked on our own channel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LeaseReleased
from ..held import HeldState, release_barrier
from ..names import token_queue
from ..transport.channel_ops import hand_on
from ..transport.shield import close_quietly
from ..transport.wire import AbstractChannel, DeliveredMessage
from .fencing import Carry
from .message import carrying

log = logging.getLogger("amqp_locks.tokens")


@dataclass(eq=False, kw_only=True)
class PermitState(HeldState):
    """A token delivered to us and left unacked on our own channel."""

    channel: AbstractChannel
    consumer_tag: str
    delivery_tag: int
    quorum: bool
    #: The token as delivered (re-published by the release when it carries its counter).
    message: DeliveredMessage
    #: (epoch, count) this holder's fencing token was made of: the release publishes the
    #: token again with count + 1. None: the release returns it as it came (reject).
    carry: Carry = None
    #: The channel has transactions selected (fencing on): the release commits. A holder
    #: without fencing rejects the token on a plain channel, with nothing to commit.
    transactional: bool = True
    #: Called by the broker's consumer cancel (the waiter's; removed on release).
    on_cancel: Callable[[Any], None] | None = field(default=None)

    def quorum_queues(self) -> tuple[str, ...]:
        return (token_queue(self.name),)

    def attach(self) -> None:
        """Watch for everything by which the broker can take the token back."""
        self._listener = self.session.add_listener(self._on_session_lost)
        self.session.leases.add(self)
        self.channel.closing.add_done_callback(self._on_channel_closed)

    def _detach(self) -> None:
        """The pooled channel outlives us: take our callbacks off it."""
        self.channel.closing.remove_done_callback(self._on_channel_closed)
        if self.on_cancel is not None:
            self.channel.on_consumer_cancel_callbacks.discard(self.on_cancel)

    def on_broker_cancel(self) -> None:
        self.lose(
            f"the broker cancelled our consumer on {token_queue(self.name)!r} "
            "(queue deleted?): the token is no longer ours"
        )

    def _on_channel_closed(self, fut: asyncio.Future[Any]) -> None:
        if self.released or self.lost_reason is not None:
            return
        exc = None if fut.cancelled() else fut.exception()
        self.lose(f"channel holding the token closed: {exc}" if exc else "channel closed")

    async def verify(self) -> bool:
        """Still held: our channel and consumer are alive and the token queue exists."""
        if self.released:
            raise LeaseReleased(f"permit {self.number} of {self.name!r} was released")
        if self.lost_reason is not None or self.channel.is_closed or not self.session.alive:
            return False
        if not await self.session.exists_passive(token_queue(self.name)):
            self.lose(f"{token_queue(self.name)!r} no longer exists")
            return False
        return True

    async def release(self) -> None:
        """Cancel our consumer (so the token is not re-delivered to us), then, in one
        transaction, either ack the token and publish it again with its counter raised
        (it carries its counter) or reject it with requeue: at the commit the broker hands
        it to the best waiting consumer. If anything fails before the commit, closing the
        channel gives the token back as it came (the broker then flags it redelivered).
        Without fencing there is no transaction: the reject alone returns the token as it
        came, flagged redelivered, so a fencing holder after us takes a fresh epoch from
        the fence queue instead of reading the carried counter."""
        if not self.begin_release():
            return
        ch = self.channel
        self._detach()
        if not self.session.alive:
            self.release_failure = f"the connection had ended ({self.session.lost_reason})"
            return
        if ch.is_closed:  # the channel's close gave the token back
            return
        # The caller does not wait for the commit: the broker hands the token on at the
        # commit whoever waits for its reply (release(wait=True) and Broker.close() wait
        # for this job).
        self.release_job = self.session.spawn(self._give_back(ch))

    async def _give_back(self, ch: AbstractChannel) -> None:
        try:
            # No need to wait for cancel-ok: the broker handles a channel's methods in
            # order, so the consumer is gone before the commit requeues the token.
            successor = None
            if self.carry is not None:
                successor = (
                    self.message.body,
                    token_queue(self.name),
                    carrying(self.message, self.carry[0], self.carry[1] + 1),
                )
            await hand_on(
                ch,
                self.consumer_tag,
                self.delivery_tag,
                republish=successor,
                transactional=self.transactional,
            )
            if not self.transactional and self.confirm_wanted:
                # release(wait=True): the broker's answer, after it
                await release_barrier(ch)
        except Exception as exc:
            log.debug("polite release failed (%s); closing the channel returns the token", exc)
            if self.confirm_wanted:
                await close_quietly(ch)
            else:
                self.session.spawn(close_quietly(ch))
            if not self.session.alive:
                self.release_failure = f"the connection ended during it ({exc})"
            elif self.confirm_wanted:
                # The channel failed (a refusal closes it): what its end gives back is the
                # broker's to finish, and no answer of ours says it did (on a quorum queue,
                # not even a majority's). wait=True promised a confirmation: say there was none.
                self.release_failure = f"its channel failed during it ({exc})"
        else:
            # Without a commit nothing is awaited: the broker handles the cancel and the
            # reject before anything the next holder of this channel sends.
            self.session.return_holder_channel(ch, transactional=self.transactional)
        log.debug("released permit %d of %r", self.number, self.name)
