"""Without a worker: the lock broker's URL from Celery's settings, call keys, option checks
at definition, a lock_limit that disagrees with the semaphore already set up (LockShapeMismatch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from amqp_locks import Broker, ConfigurationError, LockShapeMismatch, TokenSemaphore
from amqp_locks.celery import Singleton, lock_urls

from .conftest import key


def urls(**conf: Any) -> list[str]:
    app = Celery("t", set_as_current=False)
    app.conf.update(conf)
    return lock_urls(app)


def test_lock_urls_follow_the_celery_broker() -> None:
    assert urls(broker_url="amqp://guest@localhost//") == ["amqp://guest:guest@localhost:5672/%2F"]
    assert urls(broker_url="pyamqp://u:p%40x@h:1234/vh") == ["amqp://u:p%40x@h:1234/vh"]
    assert urls(broker_url="amqp://a//;amqp://b//") == [
        "amqp://guest:guest@a:5672/%2F",
        "amqp://guest:guest@b:5672/%2F",
    ]
    assert urls(broker_url="amqp://h//", broker_use_ssl={"ca_certs": "/ca.pem"}) == [
        "amqps://guest:guest@h:5671/%2F?cafile=%2Fca.pem"
    ]
    assert urls(broker_url="redis://r//", amqp_locks_url="amqp://x/,amqp://y/") == [
        "amqp://x/",
        "amqp://y/",
    ]


def test_a_broker_that_is_not_amqp_needs_amqp_locks_url() -> None:
    with pytest.raises(ConfigurationError, match="amqp_locks_url"):
        urls(broker_url="redis://localhost:6379/0")


def keyed_tasks(lock_key: Callable[..., Any]) -> tuple[Any, Any, Any]:
    """Three Singleton tasks `(a, b=2)` of an app of their own, keyed by every argument,
    by `a` alone, and by the callable `lock_key`."""
    app = Celery("t", set_as_current=False)

    @app.task(base=Singleton, shared=False)
    def every(a: Any, b: Any = 2) -> None: ...

    @app.task(base=Singleton, lock_key=["a"], shared=False)
    def some(a: Any, b: Any = 2) -> None: ...

    @app.task(base=Singleton, lock_key=lock_key, shared=False)
    def by_callable(a: Any, b: Any = 2) -> None: ...

    return every, some, by_callable


def test_keys_bind_arguments_and_select_them() -> None:
    every, some, shared = keyed_tasks(lambda a, b=2: f"x{a}")
    assert every.lock_name((1,)) == every.lock_name((), {"a": 1}) == every.lock_name((1, 2))
    assert every.lock_name((1, 3)) != every.lock_name((1, 2))
    assert some.lock_name((1, 3)) == some.lock_name((1, 4)) != some.lock_name((2, 3))
    assert shared.lock_name((1,)).startswith("celery.key.")
    assert every.lock_name((1,)).startswith(f"celery.{every.name}.")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_key": ["nope"]}, "does not take"),
        ({"lock_key": "a"}, "list of argument names"),
        ({"lock_limit": 0}, "lock_limit"),
        ({"on_conflict": "queue"}, "on_conflict"),
        ({"once": True, "lock_limit": 2}, "once=True"),
    ],
)
def test_bad_options_fail_where_the_task_is_defined(options: dict[str, Any], message: str) -> None:
    app = Celery("t", set_as_current=False)
    with pytest.raises(ConfigurationError, match=message):

        @app.task(base=Singleton, shared=False, **options)
        def task(a: int) -> None: ...

        _ = task.name  # a lazy task is made on first use


def test_lock_limit_other_than_the_semaphore_is_refused(celery_app: Any, broker: Broker) -> None:
    """A key's semaphore made on first use with 2 permits (another worker's lock_limit)
    refuses a call with lock_limit 3, naming both; so does one an administrator set up
    with 2 (an earlier release's key, with a ledger)."""
    from .app import limited

    made, set_up = key(), key()
    first = TokenSemaphore(broker, limited.lock_name((made, 0.0)), first_use=True, permits=2)
    lease = first.acquire(timeout=10)
    assert lease is not None
    lease.release(wait=True)
    with pytest.raises(LockShapeMismatch, match=r"lock_limit is 3, but .*with 2 permit"):
        limited(made, 0.0)
    TokenSemaphore(broker, limited.lock_name((set_up, 0.0))).setup(2)
    with pytest.raises(LockShapeMismatch, match=r"lock_limit is 3, but .*set up with 2 permit"):
        limited(set_up, 0.0)


def test_without_celery_the_error_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['celery'] = None\n"
        "try:\n    import amqp_locks.celery\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("FeatureUnavailable") and "amqp-locks[celery]" in out.stdout


class Plain:
    """No __repr__ or __str__ of its own: its text is its address."""

    def __init__(self, n: int) -> None:
        self.n = n


class Named(Plain):
    def __repr__(self) -> str:
        return f"Named({self.n})"


def test_a_key_holding_an_address_is_refused_naming_the_argument() -> None:
    from amqp_locks.celery import UnidentifiableKey

    every, some, by_b = keyed_tasks(lambda a, b=2: [b])
    for args in [(1, Plain(1)), (1, [2, {"x": Plain(1)}]), (1, key)]:  # key: a function
        with pytest.raises(UnidentifiableKey, match=r"argument 'b' .* at 0x.*lock_key="):
            every.lock_name(args)
    with pytest.raises(UnidentifiableKey, match=r"lock_key callable returned .* at 0x"):
        by_b.lock_name((1, Plain(1)))
    # Not in the key: no objection. A __repr__ of its own: equal values, equal keys.
    assert some.lock_name((1, Plain(1))) == some.lock_name((1, Plain(2)))
    assert every.lock_name((1, Named(1))) == every.lock_name((1, Named(1)))
    assert every.lock_name((1, Named(1))) != every.lock_name((1, Named(2)))


def test_a_key_holding_an_address_is_refused_at_enqueue() -> None:
    """Refused before anything is sent: the app's broker is a closed port, so a send
    would fail with a connection error instead."""
    from amqp_locks.celery import UnidentifiableKey

    app = Celery("t", set_as_current=False, broker="amqp://guest:guest@127.0.0.1:9//")
    app.conf.broker_connection_max_retries = 0

    @app.task(base=Singleton, shared=False)
    def plain(a: Any) -> None: ...

    @app.task(base=Singleton, once=True, shared=False)
    def once(a: Any) -> None: ...

    for task in (plain, once):
        with pytest.raises(UnidentifiableKey, match="argument 'a'"):
            task.apply_async((Plain(1),))
        with pytest.raises(UnidentifiableKey, match="argument 'a'"):
            task.delay(a=Plain(1))


def test_a_redis_broker_without_redis_py_needs_amqp_locks_url() -> None:
    """Without redis-py (nor `packaging`, which kombu's redis transport imports), the URL's
    scheme alone says it is not AMQP: the same ConfigurationError, not an ImportError."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['redis'] = sys.modules['packaging'] = None\n"
        "from celery import Celery\nfrom amqp_locks.celery import lock_urls\n"
        "app = Celery('t', set_as_current=False)\n"
        "app.conf.broker_url = 'redis://localhost:6379/0'\n"
        "try:\n    lock_urls(app)\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ConfigurationError") and "'redis'" in out.stdout, out
    assert "amqp_locks_url" in out.stdout
