"""Lock names (pure logic): which names are valid, and their mapping to queue names that
every AMQP client accepts, never two locks on one queue (names.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands

from amqp_locks import ConfigurationError, InvalidName
from amqp_locks.names import (
    COMPOUND_ENDINGS,
    LONGEST_SUFFIX,
    MAX_EXCHANGE_NAME_CHARS,
    MAX_NAME_CHARS,
    MAX_QUEUE_NAME_BYTES,
    MAX_SLOT_DIGITS,
    MAX_VHOST_CHARS,
    READABLE_MAX,
    RESERVED_ENDINGS,
    RWLOCK_READABLE_MAX,
    SAFE_CHARS,
    TOKEN_READABLE_MAX,
    check_slot_number,
    claim_exchange,
    fence_queue,
    holder_key,
    holder_queue,
    is_readable,
    mutex_queue,
    queue_base,
    quorum_mutex_name,
    rwlock_admin_name,
    rwlock_base,
    rwlock_queue,
    sentinel_queue,
    slot_queue,
    slots_name,
    standalone_queue,
    suffix_instances,
    token_base,
    token_ledger_queue,
    token_message_id,
    token_queue,
    validate_name,
    wakeup_queue,
)

#: Any text a user may pass (valid or not), biased towards the characters that matter.
_ANY_CHAR = st.characters(blacklist_categories=("Cc", "Cs"))
_TRICKY = st.sampled_from([*"=()|*:/%# .-_éü日本🙂", "-1-A", ".mutex", ".semaphore", "#"])
names = st.lists(st.one_of(_ANY_CHAR, _TRICKY), min_size=1, max_size=60).map("".join)
long_names = st.text(alphabet=st.sampled_from("ab-.#é日"), min_size=200, max_size=255)
safe_names = st.one_of(
    st.text(alphabet=st.sampled_from(sorted(SAFE_CHARS)), min_size=1, max_size=100),
    st.text(alphabet=st.sampled_from(sorted(SAFE_CHARS)), min_size=1, max_size=240),
)


def _valid(name: str) -> bool:
    try:
        validate_name(name)
    except InvalidName:
        return False
    return True


def queues(name: str) -> set[str]:
    """Every queue lock `name` can own, as any kind, in either mode (names.py)."""
    keys = [name, quorum_mutex_name(name), slots_name(name), rwlock_admin_name(name)]
    qs: set[str] = set()
    for key in keys:
        qs |= {mutex_queue(key), fence_queue(key), token_queue(key), token_ledger_queue(key)}
        for kind in ("sem", "mutex"):
            qs |= {wakeup_queue(key, kind), sentinel_queue(key, kind)}
        for k in (1, 2, 10, 99, 10**MAX_SLOT_DIGITS - 1):
            qs |= {slot_queue(key, k), holder_queue(key, k)}
    qs |= {rwlock_queue(name, role) for role in ("readers", "writer", "ledger")}  # type: ignore[arg-type]
    return qs


def accepted_by_pamqp(queue: str) -> bool:
    """What aiormq does with a queue name: pamqp builds (and validates) the frame."""
    try:
        commands.Queue.Declare(queue=queue)
    except ValueError:
        return False
    return len(queue.encode("utf-8")) <= MAX_QUEUE_NAME_BYTES


def test_queue_names_follow_the_seed() -> None:
    assert slot_queue("images", 3) == "images-3-A"
    assert holder_queue("images", 3) == "images-3-B"
    assert fence_queue("images") == "images-fence"
    assert token_queue("db") == "db.semaphore"
    assert token_ledger_queue("db") == "db.semaphore-ledger"
    assert token_queue(quorum_mutex_name("db")) == "db.mutex.semaphore"
    assert rwlock_queue("b", "readers") == "b.rwlock-readers"
    assert mutex_queue(rwlock_admin_name("b")) == "b.rwlock"


@pytest.mark.parametrize("name", ["order=42", "café", "job(1)", "tenant|job", "a*b", "日本 🙂"])
def test_names_users_build_from_data_are_escaped(name: str) -> None:
    """Issue 36 case 7: these passed validation, then pamqp refused their queues."""
    assert validate_name(name) == name
    base = queue_base(name)
    assert re.fullmatch(r"[^#]*#[a-z2-7]{32}", base)
    assert all(accepted_by_pamqp(q) for q in queues(name))


@pytest.mark.parametrize(
    "bad",
    ["", "amq.foo", "a\nb", "a\x00", "a\x85b", "\ud800", "x" * (MAX_NAME_CHARS + 1)]
    + [f"X{ending}" for ending in COMPOUND_ENDINGS],
)
def test_refuses_names_outside_the_rule(bad: str) -> None:
    with pytest.raises(InvalidName):
        validate_name(bad)


def test_refuses_non_str() -> None:
    with pytest.raises(InvalidName, match="must be a str"):
        validate_name(3)  # type: ignore[arg-type]


def test_admin_names_of_cluster_token_semaphores() -> None:
    """``TokenAdmin(b, "X.mutex")`` administers cluster-mode Mutex X (docs/cluster.md); a
    user's lock of that name would share its queue, so it is refused."""
    with pytest.raises(InvalidName, match=r"Mutex\('X'\)"):
        validate_name("X.mutex")
    assert validate_name("X.mutex", admin=True) == "X.mutex"
    assert validate_name("X.slots", admin=True) == "X.slots"
    with pytest.raises(InvalidName):
        validate_name("X.rwlock", admin=True)
    assert token_queue("X.mutex") == token_queue(quorum_mutex_name("X"))
    # The library's own compound names pass, even of a maximal user name.
    assert validate_name(quorum_mutex_name("n" * MAX_NAME_CHARS))


@pytest.mark.parametrize(
    "name", ["images-1-A", "x-fence", "x-sem-wakeups", "x-mutex-watch", "db.semaphore"]
)
def test_names_ending_like_a_suffix_are_valid_and_escaped(name: str) -> None:
    """Refused before; now valid, and escaped so they cannot alias another lock's queue."""
    assert validate_name(name) == name
    assert not is_readable(name)
    assert re.fullmatch(re.escape(name[:23]) + r"#[a-z2-7]{32}", queue_base(name))


def test_budgets() -> None:
    """General queues: 255 minus the longest general suffix (the 239 bytes of earlier
    releases). Stamped queues: their 406 refusal, a 255-byte short string, must still
    carry the stamp at its end (tokens/fresh.py); an escaped base fits either."""
    assert max(suffix_instances(), key=len) == ".rwlock-readers-waiting"
    assert RWLOCK_READABLE_MAX + len(".rwlock-readers-waiting") <= MAX_QUEUE_NAME_BYTES
    assert TOKEN_READABLE_MAX + len(".semaphore-waiting") <= MAX_QUEUE_NAME_BYTES
    assert len("-mutex-sentinels") == LONGEST_SUFFIX and READABLE_MAX == 239
    assert queue_base("x" * READABLE_MAX) == "x" * READABLE_MAX
    assert queue_base("x" * (READABLE_MAX + 1)) != "x" * (READABLE_MAX + 1)
    assert token_queue("x" * TOKEN_READABLE_MAX) == "x" * TOKEN_READABLE_MAX + ".semaphore"
    assert token_base("x" * (TOKEN_READABLE_MAX + 1)).startswith("x" * 23 + "#")
    assert rwlock_base("x" * RWLOCK_READABLE_MAX) == "x" * RWLOCK_READABLE_MAX
    assert rwlock_base("x" * (RWLOCK_READABLE_MAX + 1)).startswith("x" * 23 + "#")

    def refusal(queue: str, vhost: str = "/") -> str:
        return (
            f"PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue '{queue}' in "
            f"vhost '{vhost}': received '{2**62 - 1}' but current is '{2**62 - 1}'"
        )

    for queue in (
        token_queue("x" * TOKEN_READABLE_MAX),
        rwlock_queue("x" * RWLOCK_READABLE_MAX, "readers"),
    ):
        assert len(refusal(queue).encode()) == MAX_QUEUE_NAME_BYTES
    escaped = rwlock_queue("é" * MAX_NAME_CHARS, "readers")
    assert len(refusal(escaped, "v" * MAX_VHOST_CHARS).encode()) <= MAX_QUEUE_NAME_BYTES


@pytest.mark.parametrize("k", [0, -1, 10**MAX_SLOT_DIGITS, True, 1.0])
def test_slot_numbers_are_checked(k: object) -> None:
    with pytest.raises(ConfigurationError):
        check_slot_number(k)  # type: ignore[arg-type]


def test_suffixes_cannot_alias() -> None:
    """The injectivity argument of names.py, checked on every suffix: each starts with
    ``-`` or ``.`` and holds no ``#`` (so no escaped base ends with one), a readable base
    never ends with one, and no suffix is a non-empty head plus another suffix."""
    sfx = set(suffix_instances(1) + suffix_instances(12) + suffix_instances())
    for s in sfx - {""}:
        assert s[0] in "-." and "#" not in s, s
        assert RESERVED_ENDINGS.search("x" + s), s
        for i in range(1, len(s)):
            assert s[i:] not in sfx or s[i:] == "", (s, s[i:])


@given(names)
def test_every_queue_is_a_valid_amqp_short_string(name: str) -> None:
    if not _valid(name):
        return
    for q in queues(name):
        assert accepted_by_pamqp(q), (name, q)
    assert len(holder_key(name).encode()) <= MAX_QUEUE_NAME_BYTES
    assert len(token_message_id(name, 9_999_999).encode()) <= MAX_QUEUE_NAME_BYTES
    exchange = claim_exchange(name)
    assert len(exchange) <= MAX_EXCHANGE_NAME_CHARS
    commands.Exchange.Declare(exchange=exchange)  # raises ValueError if pamqp refuses it


@settings(max_examples=300)
@given(long_names)
def test_names_of_the_maximum_length_fit(name: str) -> None:
    if _valid(name):
        assert all(accepted_by_pamqp(q) for q in queues(name)), name


@settings(max_examples=300)
@given(safe_names)
def test_safe_names_keep_their_queues(name: str) -> None:
    """A name valid before the mapping, of safe characters only, keeps exactly its queue
    names (a deployment upgrades without moving a lock), up to the new budget."""
    old_reserved = re.compile(
        r"(-\d+-[AB]|-fence|-waiters|-sentinels|-wakeups|-watch|\.semaphore(-ledger)?"
        r"|\.rwlock(-readers|-writer|-ledger)?)$"
    )
    old_valid = (
        not name.startswith("amq.")
        and len(name) <= READABLE_MAX
        and not old_reserved.search(name)
        and not name.endswith((".mutex", ".slots"))
    )
    if not old_valid or re.search(r"#[a-z2-7]{32}$", name):
        return
    assert _valid(name)
    assert mutex_queue(name) == name
    assert slot_queue(name, 7) == f"{name}-7-A"
    assert wakeup_queue(name, "sem") == f"{name}-sem-wakeups"
    # Stamped queues worked (on the vhost /) up to 97 / 92 bytes: kept there.
    if len(name) <= TOKEN_READABLE_MAX:
        assert token_queue(name) == f"{name}.semaphore"
    if len(name) <= RWLOCK_READABLE_MAX:
        assert rwlock_queue(name, "writer") == f"{name}.rwlock-writer"
    if len(name) + len(".mutex") <= TOKEN_READABLE_MAX:
        assert token_queue(quorum_mutex_name(name)) == f"{name}.mutex.semaphore"
        assert token_queue(slots_name(name)) == f"{name}.slots.semaphore"
    assert holder_key(name) == name
    assert token_message_id(name, 3) == f"{name}#3"


@given(names, names)
def test_two_valid_names_never_share_a_queue(a: str, b: str) -> None:
    if a == b or not (_valid(a) and _valid(b)):
        return
    assert not (queues(a) & queues(b)), (a, b)
    assert queue_base(a) != queue_base(b)
    assert holder_key(a) != holder_key(b)
    assert claim_exchange(a) != claim_exchange(b)


@given(names)
def test_a_name_and_its_escaped_base_never_share_a_queue(name: str) -> None:
    """A user cannot pick another name's escaped base (or that base plus a suffix) and
    land on its queues: the readable test refuses the digest ending."""
    if not _valid(name) or is_readable(name):
        return
    base = queue_base(name)
    for other in {base, base + "-1-A", base + ".x"}:
        if _valid(other) and other != name:
            assert not (queues(other) & queues(name)), (name, other)


def test_standalone_queues() -> None:
    assert standalone_queue("amqp-locks.quorum-guard.localhost:5672") == (
        "amqp-locks.quorum-guard.localhost:5672"
    )
    odd = standalone_queue("amqp-locks.quorum-guard.hôte:5672")
    assert accepted_by_pamqp(odd) and odd != standalone_queue("amqp-locks.quorum-guard.hote:5672")
