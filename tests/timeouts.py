"""A test's timeout does not count the start-up of the servers it shares with other tests.

pytest-timeout times a test's setup, call and teardown together. The first test to use a
session- or module-scoped server (the 3-node cluster, the test node, the database servers)
then pays for starting it: up to 186 s of test_failover's 300 s on a loaded machine
(rehearsals 43 and 45: the cluster's start-up under two CPU burners), so a heavier load
would fail whichever test came first, whatever it does. Around the setup of every fixture
wider than a test, these hooks put the test's timer aside for a start-up timer of its own
(`SERVER_START`, so a server that never comes up still fails), then arm the test's timer
again with its whole budget. The test's own fixtures, body and teardown stay timed as
before. pytest-timeout's public hooks do the arming; the start-up timer is its settings
namedtuple with another timeout (`_replace`).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

SERVER_START = 900.0  # seconds a shared server may take to start (a 3-node cluster, loaded)

_SETTINGS = pytest.StashKey[Any]()
_running: list[pytest.Item] = []  # the test whose protocol runs now (one at a time)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, Any, Any]:
    """Remembers the settings pytest-timeout first armed the test's timer with."""
    item.stash.setdefault(_SETTINGS, settings)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    _running[:] = [item]
    try:
        return (yield)
    finally:
        _running.clear()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    """A shared fixture's setup runs on its own timer; the test's starts again after it."""
    item = _running[0] if _running else None
    settings = item.stash.get(_SETTINGS, None) if item is not None else None
    if item is None or settings is None or settings.func_only or fixturedef.scope == "function":
        return (yield)
    hook = item.config.hook
    hook.pytest_timeout_cancel_timer(item=item)
    hook.pytest_timeout_set_timer(item=item, settings=settings._replace(timeout=SERVER_START))
    try:
        return (yield)
    finally:
        hook.pytest_timeout_cancel_timer(item=item)
        hook.pytest_timeout_set_timer(item=item, settings=settings)
