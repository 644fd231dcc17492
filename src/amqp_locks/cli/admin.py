"""`amqp-locks semaphore ...` and `amqp-locks token ...`: the administration commands."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

import click

from ..semaphore import Removal, SemaphoreAdmin
from ..status import of_kind
from ..tokens import Audit, TokenAdmin
from ..transport.broker import Broker
from .common import CliError, get_globals, lock_name, read_status, seconds_option
from .exitcodes import Exit

T = TypeVar("T")

ADMIN_TIMEOUT = seconds_option(
    "--admin-timeout",
    default=30.0,
    help="How long to wait for the administration mutex (exit 75 after it).",
)


def _with_broker(purpose: str, action: Callable[[Broker], T]) -> T:
    broker = get_globals().broker(purpose)
    try:
        return action(broker)
    finally:
        broker.close()


def _removal_text(r: Removal) -> str:
    parts = [f"removed {len(r.removed)} slot(s)"]
    if r.removed:
        parts[0] += " " + ",".join(map(str, r.removed))
    if r.overshoot_removed:
        parts.append("overshoot removed " + ",".join(map(str, r.overshoot_removed)))
    if r.still_held:
        parts.append("still held " + ",".join(map(str, r.still_held)))
    return "; ".join(parts)


def _require_semaphore(admin: SemaphoreAdmin) -> int:
    c = admin.max_slots()
    if c == 0:
        raise CliError(Exit.DATAERR, f"semaphore {admin.name!r} does not exist")
    return c


# --- persistent semaphore --------------------------------------------------------------------


@click.group(
    epilog="""\b
Examples:
  amqp-locks semaphore create deploys 3
  amqp-locks semaphore add deploys 2
  amqp-locks semaphore remove deploys 1 --wait 60
  amqp-locks semaphore holders deploys
  amqp-locks semaphore wait deploys --timeout 300
  amqp-locks semaphore destroy deploys"""
)
def semaphore() -> None:
    """Administer persistent semaphores (durable slot queues)."""


@semaphore.command("create")
@click.argument("name")
@click.argument("slots", type=click.IntRange(min=1))
@click.option("--quorum", is_flag=True, help="Quorum slot queues (default in cluster mode).")
@ADMIN_TIMEOUT
def sem_create(name: str, slots: int, quorum: bool, admin_timeout: float) -> None:
    """Create semaphore NAME with SLOTS slots (idempotent for the same count)."""
    name = lock_name(name)

    def act(b: Broker) -> int:
        admin = SemaphoreAdmin(b, name, quorum=quorum or None, mutex_timeout=admin_timeout)
        return admin.create(slots)

    click.echo(_with_broker(f"semaphore create {name}", act))


@semaphore.command("destroy")
@click.argument("name")
@click.option("--purge-fence", is_flag=True, help="Also delete the fencing-token queue.")
@click.option(
    "--overshoot", type=click.IntRange(min=0), default=0, help="Also look this far beyond."
)
@ADMIN_TIMEOUT
def sem_destroy(name: str, purge_fence: bool, overshoot: int, admin_timeout: float) -> None:
    """Delete every slot of NAME (holders are told they lost their slot)."""
    name = lock_name(name)

    def act(b: Broker) -> Removal:
        admin = SemaphoreAdmin(b, name, overshoot=overshoot, mutex_timeout=admin_timeout)
        _require_semaphore(admin)
        return admin.destroy(purge_fence=purge_fence)

    click.echo(_removal_text(_with_broker(f"semaphore destroy {name}", act)))


@semaphore.command("repair-fence")
@click.argument("name")
@click.option(
    "--floor",
    type=click.IntRange(min=0),
    required=True,
    help="The highest fencing token any of your resources accepted from a lock of NAME's shard.",
)
@ADMIN_TIMEOUT
def sem_repair_fence(name: str, floor: int, admin_timeout: float) -> None:
    """Rebuild the fencing counter of NAME's shard if it was deleted by hand, with every
    token above FLOOR (prints whether it was rebuilt)."""
    name = lock_name(name)

    def act(b: Broker) -> bool:
        return SemaphoreAdmin(b, name, mutex_timeout=admin_timeout).repair_fence(floor)

    rebuilt = _with_broker(f"semaphore repair-fence {name}", act)
    click.echo("rebuilt" if rebuilt else "present: nothing to rebuild")


@semaphore.command("add")
@click.argument("name")
@click.argument("count", type=click.IntRange(min=1))
@ADMIN_TIMEOUT
def sem_add(name: str, count: int, admin_timeout: float) -> None:
    """Add COUNT slots to NAME; prints the new number of slots."""
    name = lock_name(name)

    def act(b: Broker) -> int:
        admin = SemaphoreAdmin(b, name, mutex_timeout=admin_timeout)
        _require_semaphore(admin)
        return admin.add_slots(count)

    click.echo(_with_broker(f"semaphore add {name}", act))


@semaphore.command("remove")
@click.argument("name")
@click.argument("count", type=click.IntRange(min=1))
@seconds_option(
    "--wait",
    default=0.0,
    show_default=False,
    help="Wait up to SECONDS for holders of removed slots to let go (exit 75 if some don't).",
)
@ADMIN_TIMEOUT
def sem_remove(name: str, count: int, wait: float, admin_timeout: float) -> int:
    """Remove the COUNT highest slots of NAME (their holders lose them)."""
    name = lock_name(name)

    def act(b: Broker) -> Removal:
        admin = SemaphoreAdmin(b, name, mutex_timeout=admin_timeout)
        _require_semaphore(admin)
        return admin.remove_slots(count, wait=wait)

    removal = _with_broker(f"semaphore remove {name}", act)
    click.echo(_removal_text(removal))
    return Exit.TEMPFAIL if wait > 0 and removal.still_held else Exit.OK


@semaphore.command("max")
@click.argument("name")
@ADMIN_TIMEOUT
def sem_max(name: str, admin_timeout: float) -> None:
    """Print the number of slots of NAME (0: it does not exist)."""
    name = lock_name(name)
    click.echo(
        _with_broker(
            f"semaphore max {name}",
            lambda b: SemaphoreAdmin(b, name, mutex_timeout=admin_timeout).max_slots(),
        )
    )


@semaphore.command("holders")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="A JSON list.")
@ADMIN_TIMEOUT
def sem_holders(name: str, as_json: bool, admin_timeout: float) -> None:
    """Print the held slot numbers of NAME, one per line."""
    name = lock_name(name)

    def act(b: Broker) -> list[int]:
        admin = SemaphoreAdmin(b, name, mutex_timeout=admin_timeout)
        _require_semaphore(admin)
        return admin.holders()

    held = _with_broker(f"semaphore holders {name}", act)
    if as_json:
        click.echo(json.dumps(held))
    else:
        for k in held:
            click.echo(k)


@semaphore.command("wait")
@click.argument("name")
@click.argument("slots", nargs=-1, type=click.IntRange(min=1))
@seconds_option("--timeout", help="Give up after SECONDS (exit 75, still-held slots printed).")
def sem_wait(name: str, slots: tuple[int, ...], timeout: float | None) -> int:
    """Wait until SLOTS of NAME (default: all) are no longer held."""
    name = lock_name(name)

    def act(b: Broker) -> list[int]:
        admin = SemaphoreAdmin(b, name)
        wanted = list(slots)
        if not wanted:
            sem = of_kind(read_status(b, name, ("semaphore",)), "semaphore")
            c = 0 if sem is None else sem.capacity
            if c == 0:
                raise CliError(Exit.DATAERR, f"semaphore {name!r} does not exist")
            wanted = list(range(1, c + 1))
        return admin.wait_for_holders(wanted, timeout)

    still = _with_broker(f"semaphore wait {name}", act)
    if still:
        click.echo("still held: " + ",".join(map(str, still)))
        return Exit.TEMPFAIL
    return Exit.OK


# --- token semaphore -------------------------------------------------------------------------


@click.group(
    epilog="""\b
Examples:
  amqp-locks token setup gpu 2
  amqp-locks token add gpu 1
  amqp-locks token status gpu --json
  amqp-locks token audit gpu --timeout 10"""
)
def token() -> None:
    """Administer token semaphores (a queue of permit messages)."""


def _tokens(b: Broker, name: str, admin_timeout: float = 30.0, quorum: bool = False) -> TokenAdmin:
    return TokenAdmin(b, name, mutex_timeout=admin_timeout, quorum=quorum or None)


@token.command("setup")
@click.argument("name")
@click.argument("permits", type=click.IntRange(min=1))
@click.option("--quorum", is_flag=True, help="A quorum token queue (default in cluster mode).")
@ADMIN_TIMEOUT
def tok_setup(name: str, permits: int, quorum: bool, admin_timeout: float) -> None:
    """Set up token semaphore NAME with PERMITS permits (idempotent for the same count)."""
    name = lock_name(name, admin=True)
    click.echo(
        _with_broker(
            f"token setup {name}", lambda b: _tokens(b, name, admin_timeout, quorum).setup(permits)
        )
    )


@token.command("add")
@click.argument("name")
@click.argument("count", type=click.IntRange(min=1))
@ADMIN_TIMEOUT
def tok_add(name: str, count: int, admin_timeout: float) -> None:
    """Add COUNT permits; prints their ids."""
    name = lock_name(name, admin=True)
    ids = _with_broker(
        f"token add {name}", lambda b: _tokens(b, name, admin_timeout).add_permits(count)
    )
    click.echo(" ".join(map(str, ids)))


@token.command("remove")
@click.argument("name")
@click.argument("count", type=click.IntRange(min=1))
@seconds_option(
    "--timeout",
    help="Wait up to SECONDS for held permits to come back (exit 75 if fewer were removed).",
)
@ADMIN_TIMEOUT
def tok_remove(name: str, count: int, timeout: float | None, admin_timeout: float) -> int:
    """Take COUNT permits out of circulation; prints the removed ids."""
    name = lock_name(name, admin=True)
    ids = _with_broker(
        f"token remove {name}",
        lambda b: _tokens(b, name, admin_timeout).remove_permits(count, timeout),
    )
    click.echo(" ".join(map(str, ids)))
    return Exit.OK if len(ids) >= count else Exit.TEMPFAIL


@token.command("status")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def tok_status(name: str, as_json: bool) -> None:
    """Permits, ready, held, consumers and waiters of NAME."""
    name = lock_name(name, admin=True)
    st = _with_broker(f"token status {name}", lambda b: _tokens(b, name).status())
    data = {
        "name": name,
        "permits": st.permits,
        "ready": st.ready,
        "held": st.held,
        "consumers": st.consumers,
        "waiting": st.waiting,
    }
    if as_json:
        click.echo(json.dumps(data))
    else:
        click.echo(" ".join(f"{k}={v}" for k, v in data.items()))


def _audit_out(a: Audit, as_json: bool) -> int:
    data = {
        "permits": a.permits,
        "seen": list(a.seen),
        "missing": list(a.missing),
        "surplus": list(a.surplus),
        "ok": a.ok,
    }
    if as_json:
        click.echo(json.dumps(data))
    else:
        click.echo(
            f"permits={a.permits} seen={len(a.seen)} "
            f"missing={','.join(map(str, a.missing)) or '-'} "
            f"surplus={','.join(map(str, a.surplus)) or '-'}"
        )
    return Exit.OK if a.ok else Exit.DATAERR


AUDIT_TIMEOUT = seconds_option(
    "--timeout",
    default=5.0,
    help="How long to collect tokens (held ones are seen when they come back).",
)


@token.command("audit")
@click.argument("name")
@AUDIT_TIMEOUT
@click.option("--json", "as_json", is_flag=True)
@ADMIN_TIMEOUT
def tok_audit(name: str, timeout: float, as_json: bool, admin_timeout: float) -> int:
    """Count every token of NAME against the ledger (exit 65 if some are missing or
    duplicated)."""
    name = lock_name(name, admin=True)
    a = _with_broker(
        f"token audit {name}", lambda b: _tokens(b, name, admin_timeout).audit(timeout)
    )
    return _audit_out(a, as_json)


@token.command("repair")
@click.argument("name")
@AUDIT_TIMEOUT
@click.option("--json", "as_json", is_flag=True)
@ADMIN_TIMEOUT
def tok_repair(name: str, timeout: float, as_json: bool, admin_timeout: float) -> None:
    """Audit NAME, re-publish missing tokens and drop duplicates (prints what it found)."""
    name = lock_name(name, admin=True)
    a = _with_broker(
        f"token repair {name}", lambda b: _tokens(b, name, admin_timeout).repair(timeout)
    )
    _audit_out(a, as_json)


@token.command("destroy")
@click.argument("name")
@click.option(
    "--purge-fence",
    is_flag=True,
    help="Also delete its fencing-token queue NAME-fence (kept by default, so tokens keep "
    "rising if NAME is set up again).",
)
@ADMIN_TIMEOUT
def tok_destroy(name: str, purge_fence: bool, admin_timeout: float) -> None:
    """Delete the token queue and ledger of NAME (holders lose their permits)."""
    name = lock_name(name, admin=True)
    _with_broker(
        f"token destroy {name}",
        lambda b: _tokens(b, name, admin_timeout).destroy(purge_fence=purge_fence),
    )
