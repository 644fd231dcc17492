"""The row of docs/celery.md's comparison that matters most, measured rather than quoted:
celery-once (QueueOnce on a private Redis) keeps a SIGKILLed worker's key locked until its
timeout, while amqp-locks frees it with the connection (tests/celery/test_kill.py,
test_once.py). Skipped when celery-once is not installed (the dev and bench groups have it)
or no Redis can be had."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks_dev import devbroker

from .conftest import Worker, key

celery_once = pytest.importorskip("celery_once")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    from amqp_locks_dev import devredis

    from ..nodes import test_home

    home = test_home()
    base = (home / "redis-celery") if home else None
    was_running = devredis.status("celery-test", base) is not None
    try:
        info = devredis.start("celery-test", base)
    except devredis.DevRedisError as exc:
        pytest.skip(f"no Redis for the celery-once comparison: {exc}")
    yield info.url
    if not was_running:
        devredis.stop("celery-test", base)


def test_celery_once_keeps_a_killed_workers_key_until_its_timeout(
    node: devbroker.NodeInfo, celery_home: Path, celery_app: Any, redis_url: str
) -> None:
    import redis

    from .app import with_celery_once

    celery_app.conf.ONCE["settings"]["url"] = redis_url
    worker = Worker(node.url, celery_home, "prefork", 2, env={"CELERY_TEST_REDIS": redis_url})
    try:
        k = key()
        result = with_celery_once.apply_async((k, 60.0), queue=worker.queue)
        victim = worker.wait_events(k, "start", 1)[0].pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(Exception, match="Worker exited prematurely"):
            result.get(timeout=30)
        with pytest.raises(celery_once.AlreadyQueued) as refused:
            with_celery_once.apply_async((k, 0.0), queue=worker.queue)
        assert refused.value.countdown > 3500  # locked for the rest of its hour
        lock_key = with_celery_once.get_key((k, 0.0), {})
        assert redis.Redis.from_url(redis_url).delete(lock_key) == 1  # clean up by hand
    finally:
        worker.stop()
