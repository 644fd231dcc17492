"""The subprocess reader the CLI tests wait on (`conftest.Proc`). Each stream is read on a
thread of its own, so lines of one stream can be read here before lines of the other that
the process wrote first: waiting for a line on one stream must not consume the other's
(a CI run failed that way: a master's second stdout line was taken while a stderr line
was awaited, and the wait for it then timed out)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .. import waiting
from .conftest import Proc

# Two stdout lines; a stderr line only once a line comes on stdin; then stays until EOF.
SCRIPT = """
import sys
print("out one", flush=True)
print("out two", flush=True)
sys.stdin.readline()
print("err one", file=sys.stderr, flush=True)
sys.stdin.read()
"""


def test_waiting_on_one_stream_keeps_the_other_streams_lines() -> None:
    popen = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p = Proc(popen)
    p.start_pumps()
    assert popen.stdin is not None
    try:
        waiting.wait_until(lambda: len(p.out) == 2, 20, "both stdout lines read")
        popen.stdin.write("go\n")
        popen.stdin.flush()
        assert p.expect("err", which="err") == "err one"
        # Both stdout lines were read before the stderr one; they are still there, in order.
        assert (p.expect("out"), p.expect("out")) == ("out one", "out two")
        with pytest.raises(AssertionError, match=r"no line with 'out' within 0\.2s"):
            p.expect("out", timeout=0.2)
    finally:
        popen.stdin.close()
    assert p.finish() == (0, "out one\nout two", "err one")
