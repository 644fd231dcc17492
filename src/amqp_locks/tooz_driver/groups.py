"""tooz groups and their members: the registry of groups, member records in each group's
snapshot, and liveness by the members' exclusive queues."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import tooz
from tooz import coordination, utils

from ..errors import ResourceLocked
from ..transport.session import Session
from .base import DriverBase, T
from .names import REGISTRY_LOCK, REGISTRY_QUEUE, as_bytes, tooz_name
from .snapshot import FLAG_ARGS, Members, now_ms


class GroupsMixin(DriverBase):
    """``create_group`` .. ``update_capabilities`` of tooz's coordinator API."""

    # --- helpers ---------------------------------------------------------------------------

    def _registry_txn(
        self, fn: Callable[[Session, dict[str, Any]], Awaitable[tuple[bool, T]]]
    ) -> T:
        """A transaction on the list of groups (the caller holds its mutex)."""
        return self._txn(REGISTRY_QUEUE, fn, lambda: tooz.ToozError("registry vanished"))

    def _edit_registry(self, edit: Callable[[list[bytes]], list[bytes]]) -> None:
        """Rewrite the list of groups as `edit` returns it (unchanged: not rewritten)."""

        async def apply(session: Session, state: dict[str, Any]) -> tuple[bool, None]:
            groups = [bytes(g) for g in state.get("groups", [])]
            edited = edit(groups)
            if edited == groups:
                return False, None
            state["groups"] = edited
            return True, None

        self._registry_txn(apply)

    async def _live_member(
        self, session: Session, group_id: bytes, members: Members, member_id: bytes
    ) -> bool:
        """:meth:`_live`, then MemberNotJoined unless `member_id` is among the live.

        The error makes the transaction discard its snapshot, stale records included: the
        next transaction on the group drops them again."""
        changed, live = await self._live(session, group_id, members)
        if member_id not in live:
            raise coordination.MemberNotJoined(group_id, member_id)
        return changed

    def _member_record(self, group_id: bytes, member_id: bytes) -> dict[str, Any]:
        async def read(session: Session, members: Members) -> tuple[bool, dict[str, Any]]:
            changed = await self._live_member(session, group_id, members, member_id)
            return changed, dict(members.records[member_id])

        return self._group_txn(group_id, read)

    # --- groups ----------------------------------------------------------------------------

    def create_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = as_bytes(group_id)

        def create() -> None:
            queue = tooz_name(group_id, "group")
            with self._held(REGISTRY_LOCK):

                async def exists(session: Session) -> bool:
                    await session.declare(REGISTRY_QUEUE, durable=True)
                    return (await session.probe([queue]))[0]

                if self.on_session(exists):
                    raise coordination.GroupAlreadyExist(group_id)
                # Listed first, created second: a crash in between leaves a listed group
                # without a queue, which get_groups drops.
                self._edit_registry(lambda gs: gs if group_id in gs else [*gs, group_id])
                self.on_session(lambda s: s.declare(queue, durable=True))

        return self._submit(create)

    def get_groups(self) -> coordination.CoordinatorResult[list[bytes]]:
        def groups() -> list[bytes]:
            with self._held(REGISTRY_LOCK):
                self.on_session(lambda s: s.declare(REGISTRY_QUEUE, durable=True))

                async def listed(
                    session: Session, state: dict[str, Any]
                ) -> tuple[bool, list[bytes]]:
                    names = [bytes(g) for g in state.get("groups", [])]
                    alive = await session.probe([tooz_name(g, "group") for g in names])
                    live = [g for g, ok in zip(names, alive, strict=True) if ok]
                    if len(live) != len(names):
                        state["groups"] = live
                        return True, live
                    return False, live

                return self._registry_txn(listed)

        return self._submit(groups)

    def delete_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = as_bytes(group_id)

        def delete() -> None:
            with self._held(REGISTRY_LOCK):

                async def check(session: Session, members: Members) -> tuple[bool, None]:
                    _, live = await self._live(session, group_id, members)
                    if live:
                        raise coordination.GroupNotEmpty(group_id)
                    await session.delete(tooz_name(group_id, "group"))
                    return False, None

                self._group_txn(group_id, check)
                self._edit_registry(lambda gs: [g for g in gs if g != group_id])

        return self._submit(delete)

    # --- members ---------------------------------------------------------------------------

    def join_group(
        self, group_id: bytes, capabilities: coordination.Capabilities | None = None
    ) -> coordination.CoordinatorResult[None]:
        group_id = as_bytes(group_id)
        member_id = self._member_id
        caps = capabilities

        def join() -> None:
            queue = tooz_name(group_id, "member", member_id)

            async def add(session: Session, members: Members) -> tuple[bool, None]:
                _, live = await self._live(session, group_id, members)
                if member_id in live:
                    raise coordination.MemberAlreadyExist(group_id, member_id)
                try:
                    await session.declare(queue, exclusive=True, arguments=FLAG_ARGS)
                except ResourceLocked:
                    raise coordination.MemberAlreadyExist(group_id, member_id) from None
                self._member_queues[group_id] = queue
                now = now_ms()
                members.records[member_id] = {
                    "id": member_id,
                    "caps": caps,
                    "created_at": now,
                    "updated_at": now,
                }
                return True, None

            self._group_txn(group_id, add)
            self._joined_groups.add(group_id)

        return self._submit(join)

    def leave_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = as_bytes(group_id)
        member_id = self._member_id

        def leave() -> None:
            async def remove(session: Session, members: Members) -> tuple[bool, None]:
                await self._live_member(session, group_id, members, member_id)
                del members.records[member_id]
                return True, None

            try:
                self._group_txn(group_id, remove)
            finally:
                self._joined_groups.discard(group_id)
            queue = self._member_queues.pop(group_id, None)
            if queue is not None:
                self.on_session(lambda s: s.delete(queue))

        return self._submit(leave)

    def get_members(self, group_id: bytes) -> coordination.CoordinatorResult[set[bytes]]:
        group_id = as_bytes(group_id)

        def members() -> set[bytes]:
            async def read(session: Session, members: Members) -> tuple[bool, set[bytes]]:
                return await self._live(session, group_id, members)

            return self._group_txn(group_id, read)

        return self._submit(members)

    def get_member_capabilities(
        self, group_id: bytes, member_id: bytes
    ) -> coordination.CoordinatorResult[coordination.Capabilities | None]:
        group_id, member_id = as_bytes(group_id), as_bytes(member_id)
        return self._submit(lambda: self._member_record(group_id, member_id)["caps"])

    def get_member_info(
        self, group_id: bytes, member_id: bytes
    ) -> coordination.CoordinatorResult[dict[str, Any]]:
        group_id, member_id = as_bytes(group_id), as_bytes(member_id)

        def info() -> dict[str, Any]:
            rec = self._member_record(group_id, member_id)
            return {
                "capabilities": rec["caps"],
                "created_at": utils.millis_to_datetime(rec["created_at"]),
                "updated_at": utils.millis_to_datetime(rec["updated_at"]),
            }

        return self._submit(info)

    def get_members_with_capabilities(
        self, group_id: bytes
    ) -> coordination.CoordinatorResult[dict[bytes, coordination.Capabilities | None]]:
        group_id = as_bytes(group_id)

        def read_all() -> dict[bytes, coordination.Capabilities | None]:
            async def read(session: Session, members: Members) -> tuple[bool, dict[bytes, Any]]:
                changed, live = await self._live(session, group_id, members)
                return changed, {m: members.records[m]["caps"] for m in live}

            return self._group_txn(group_id, read)

        return self._submit(read_all)

    def update_capabilities(
        self, group_id: bytes, capabilities: coordination.Capabilities
    ) -> coordination.CoordinatorResult[None]:
        group_id = as_bytes(group_id)
        member_id = self._member_id

        def update() -> None:
            async def write(session: Session, members: Members) -> tuple[bool, None]:
                await self._live_member(session, group_id, members, member_id)
                rec = members.records[member_id]
                rec["caps"] = capabilities
                rec["updated_at"] = now_ms()
                return True, None

            self._group_txn(group_id, write)

        return self._submit(update)
