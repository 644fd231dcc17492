"""tests/timeouts.py: a slow shared server's start-up is not charged to the test that
happens to come first, while the test's own fixtures and body stay timed (a fixture's
error at setup is reported as an error, not a failure).

Run in a separate pytest process (pytester): pytest-timeout's signal timer belongs to the
process, and this test's own timer must not be touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

# A shared server that takes 2 s to start, and a test's own fixture that takes as long;
# time.sleep stands for the slow work itself here, not for waiting on an event.
SERVERS = """
import time
import pytest

@pytest.fixture(scope="session")
def server():
    time.sleep(2.0)

@pytest.fixture
def own_setup():
    time.sleep(2.0)
"""

TESTS = """
import pytest

@pytest.mark.timeout(1.5)
def test_first_to_use_the_server(server):
    pass

@pytest.mark.timeout(1.5)
def test_slow_own_fixture(own_setup):
    pass
"""

HOOK = (
    "from tests.timeouts import"
    " pytest_fixture_setup, pytest_runtest_protocol, pytest_timeout_set_timer\n"
)


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, conftest: str) -> Any:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_inner=TESTS)
    return pytester.runpytest_subprocess("-ra", "-p", "no:cacheprovider")


def test_the_shared_servers_start_up_is_not_the_tests_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, HOOK + SERVERS)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["ERROR test_inner.py::test_slow_own_fixture - Failed: Timeout*"])


def test_without_it_the_first_test_pays_for_the_servers_start_up(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: pytest-timeout alone fails the test that came first."""
    result = _run(pytester, monkeypatch, SERVERS)
    result.assert_outcomes(passed=0, errors=2)
    result.stdout.fnmatch_lines(
        ["ERROR test_inner.py::test_first_to_use_the_server - Failed: Timeout*"]
    )
