"""The 406 reader (transport/refusals.py) on the texts RabbitMQ 3.10.8 and 4.3.6 really sent.

tests/data/refusals.json holds them, captured from both lines (``python -m tests.test_refusals
URL`` against a private node prints the running line's); the integration test checks that
the running broker still words them so.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import aiormq
import pytest

from amqp_locks import Broker
from amqp_locks.errors import PreconditionFailed
from amqp_locks.transport.errors import channel_error
from amqp_locks.transport.line_args import held_value, names_argument
from amqp_locks.transport.refusals import Inequivalent, inequivalent, invalid_arg
from amqp_locks.transport.session import Session

from .conftest import on_session

FIXTURES = Path(__file__).parent / "data" / "refusals.json"
#: The captured queue names: a unique suffix of this many zeros stands for the run's own.
PREFIX = "amqp-locks.refusal-fixture."
LONG = PREFIX + "x" * 190 + "."
SUFFIX = "0" * 32
LINES = ("3.10.8", "4.3.6")


def _texts() -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = json.loads(FIXTURES.read_text())
    return data


async def capture(url: str) -> tuple[str, dict[str, str]]:
    """(broker version, {case: the 406 reply text}) from the broker at `url`, its queue
    names' unique part written as zeros."""
    suffix = uuid.uuid4().hex
    short, long = PREFIX + suffix, LONG + suffix
    conn = await aiormq.connect(url)
    try:
        version = conn.server_properties["version"]
        version = version.decode() if isinstance(version, bytes) else str(version)
        texts: dict[str, str] = {}

        async def refused(case: str, queue: str, arguments: dict[str, object]) -> None:
            ch = await conn.channel()
            try:
                await ch.queue_declare(queue, durable=True, arguments=arguments)
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                texts[case] = " ".join(str(a) for a in exc.args).replace(suffix, SUFFIX)
            else:
                raise AssertionError(f"{case}: the broker accepted the declaration")

        keep = await conn.channel()
        try:
            await refused("invalid", short, {"x-max-length": -1})
            await keep.queue_declare(short, durable=True, arguments={"x-max-length": 5})
            await refused("other_value", short, {"x-max-length": 7})
            await refused("sent_none", short, {})
            await refused("queue_has_none", short, {"x-max-length": 5, "x-expires": 60_000})
            await keep.queue_declare(long, durable=True, arguments={"x-max-length": 5})
            await refused("cut_short", long, {"x-max-length": 7})
        finally:
            for queue in (short, long):
                await keep.queue_delete(queue)
        return version, texts
    finally:
        await conn.close()


@pytest.mark.parametrize("line", LINES)
def test_another_value_is_read(line: str) -> None:
    text = _texts()[line]["other_value"]
    assert inequivalent(text) == Inequivalent("x-max-length", current="5", received="7", read=True)
    assert inequivalent(text).current_int == 5  # type: ignore[union-attr]


@pytest.mark.parametrize("line", LINES)
def test_a_value_we_did_not_send_is_read(line: str) -> None:
    text = _texts()[line]["sent_none"]
    assert inequivalent(text) == Inequivalent("x-max-length", current="5", received=None, read=True)


@pytest.mark.parametrize("line", LINES)
def test_an_argument_the_queue_lacks_is_read(line: str) -> None:
    got = inequivalent(_texts()[line]["queue_has_none"])
    assert got == Inequivalent("x-expires", current=None, received="60000", read=True)
    assert got is not None and got.current_int is None


@pytest.mark.parametrize("line", LINES)
def test_a_text_cut_at_255_bytes_is_still_a_refusal_without_values(line: str) -> None:
    text = _texts()[line]["cut_short"]
    assert len(text.encode()) == 255  # RabbitMQ's short string: the values were cut off
    assert inequivalent(text) == Inequivalent("x-max-length", read=False)
    # What the callers conclude: refused because the queue exists, its value unknown.
    assert held_value(text, "x-max-length") is None
    assert not names_argument(text, "x-max-length")


@pytest.mark.parametrize("line", LINES)
def test_an_invalid_argument_is_not_an_inequivalent_one(line: str) -> None:
    text = _texts()[line]["invalid"]
    assert invalid_arg(text) == "x-max-length"
    assert inequivalent(text) is None
    assert invalid_arg(_texts()[line]["other_value"]) is None


@pytest.mark.parametrize("line", LINES)
def test_the_library_wording_around_the_text_is_read_alike(line: str) -> None:
    """Callers read `str(PreconditionFailed)`, which wraps the broker's text and names the
    queue (transport/errors.py): a queue name is never taken for the argument."""
    raw = _texts()[line]["other_value"]
    exc = channel_error(
        aiormq.exceptions.ChannelPreconditionFailed(raw), "inequivalent arg 'x-expires' q"
    )
    assert inequivalent(exc) == inequivalent(raw)
    assert held_value(str(exc), "x-max-length") == 5


@pytest.mark.parametrize("line", LINES)
def test_a_refusal_is_read_once_when_it_arrives(line: str) -> None:
    """The PreconditionFailed a refused declaration raises carries the fields its text
    gave, read when it was made: asking it again reads no text."""
    texts = _texts()[line]
    exc = channel_error(aiormq.exceptions.ChannelPreconditionFailed(texts["other_value"]), "q")
    assert isinstance(exc, PreconditionFailed)
    assert exc.refusal == inequivalent(texts["other_value"]) and exc.invalid_arg is None
    assert inequivalent(exc) is exc.refusal
    assert held_value(exc, "x-max-length") == 5 and names_argument(exc, "x-max-length")
    invalid = channel_error(aiormq.exceptions.ChannelPreconditionFailed(texts["invalid"]), "q")
    assert isinstance(invalid, PreconditionFailed)
    assert invalid.refusal is None and invalid_arg(invalid) == "x-max-length"
    # One the library raises itself says nothing about arguments, whatever its words.
    ours = PreconditionFailed("inequivalent arg 'x-max-length' ... current is '5'", "q")
    assert inequivalent(ours) is None and held_value(ours, "x-max-length") is None


def test_a_broker_refusal_carries_its_fields(broker: Broker, name: str) -> None:
    async def twice(session: Session) -> PreconditionFailed:
        await session.declare(name, durable=True, arguments={"x-max-length": 5})
        try:
            await session.declare(name, durable=True, arguments={"x-max-length": 7})
        except PreconditionFailed as exc:
            return exc
        finally:
            await session.delete(name)
        raise AssertionError("the broker accepted another x-max-length")

    exc = on_session(broker, twice)
    assert exc.queue == name and exc.refusal is not None
    assert (exc.refusal.arg, exc.refusal.current_int, exc.refusal.received) == (
        "x-max-length",
        5,
        "7",
    )


def test_a_text_about_something_else_is_none() -> None:
    assert inequivalent("NOT_FOUND - no queue 'q' in vhost '/'") is None
    assert invalid_arg("NOT_FOUND - no queue 'q' in vhost '/'") is None


def test_the_running_broker_words_them_as_captured(amqp_url: str) -> None:
    version, texts = asyncio.run(capture(amqp_url))
    assert version in _texts(), f"no fixture for RabbitMQ {version}: capture it (module doc)"
    assert texts == _texts()[version]


if __name__ == "__main__":
    found_version, found = asyncio.run(capture(sys.argv[1]))
    print(json.dumps({found_version: found}, indent=2))
