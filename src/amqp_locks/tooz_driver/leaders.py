"""tooz leader election: the mutex ``tooz.<G>.leader`` and the exclusive queue
``tooz.<G>.leader.<M>`` whose existence ``get_leader`` trusts."""

from __future__ import annotations

import contextlib
from typing import Any

from tooz import coordination

from .. import Lease, Mutex
from ..errors import AmqpLocksError
from ..transport.session import Session
from .base import DriverBase
from .names import as_bytes, tooz_name
from .snapshot import FLAG_ARGS, Members, translated


class LeadersMixin(DriverBase):
    """``get_leader``, ``stand_down_group_leader`` and the election ``run_watchers`` runs."""

    def get_leader(self, group_id: bytes) -> coordination.CoordinatorResult[bytes]:
        group_id = as_bytes(group_id)

        def leader() -> bytes:
            async def read(session: Session, members: Members) -> tuple[bool, Any]:
                named = members.state.get("leader")
                if not named:
                    return False, None
                named = bytes(named)
                alive = (await session.probe([tooz_name(group_id, "leader", named)]))[0]
                return False, named if alive else None

            result: bytes = self._group_txn(group_id, read)
            return result

        return self._submit(leader)

    def get_leader_lease(self, group_id: bytes) -> Lease | None:
        """Extra: this coordinator's leadership of `group_id` as a :class:`Lease` (its
        ``fencing_token`` rises with every election; ``lost`` is set if the connection
        dies), or None when it does not lead the group."""
        lease = self._leaders.get(as_bytes(group_id))
        return lease if lease is not None and lease.held else None

    def _try_lead(self, group_id: bytes) -> bool:
        current = self._leaders.get(group_id)
        if current is not None:
            if current.held:
                return False  # still leader: no new event
            self._leaders.pop(group_id, None)
        with translated():
            lease = Mutex(self.broker, tooz_name(group_id, "leader")).acquire(blocking=False)
        if lease is None:
            return False
        flag = tooz_name(group_id, "leader", self._member_id)
        member_id = self._member_id

        async def write(session: Session, members: Members) -> tuple[bool, None]:
            members.state["leader"] = member_id
            return True, None

        try:
            with translated():
                self.on_session(lambda s: s.declare(flag, exclusive=True, arguments=FLAG_ARGS))
                self._group_txn(group_id, write)
        except coordination.GroupNotCreated:
            self._drop_leadership(group_id, lease)
            return False
        except BaseException:
            self._drop_leadership(group_id, lease)
            raise
        self._leaders[group_id] = lease
        return True

    def _drop_leadership(self, group_id: bytes, lease: Lease) -> None:
        flag = tooz_name(group_id, "leader", self._member_id)
        try:
            with contextlib.suppress(AmqpLocksError):
                self.on_session(lambda s: s.delete(flag))
        finally:
            lease.release()

    def stand_down_group_leader(self, group_id: bytes) -> bool:
        group_id = as_bytes(group_id)
        lease = self._leaders.pop(group_id, None)
        if lease is None:
            return False
        with translated():
            self._drop_leadership(group_id, lease)
        return True

    def run_elect_coordinator(self) -> None:
        for group_id, hooks in list(self._hooks_elected_leader.items()):
            if self._try_lead(group_id):
                hooks.run(coordination.LeaderElected(group_id, self._member_id))

    def run_watchers(self, timeout: float | None = None) -> list[Any]:
        result = super().run_watchers(timeout=timeout)
        self.run_elect_coordinator()
        return result
