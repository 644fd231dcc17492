"""The one reader of RabbitMQ's 406 PRECONDITION_FAILED texts about queue arguments.

AMQP 0-9-1 gives a refused declaration only a reply code and a short string, so which
argument differs, and the queue's own value of it, are in the text. The protocols lean on
that text (a stamped test-and-set learns the count of the queue it lost to, a declaration
adapts to a queue another broker line made), so it is read here, once, into typed fields,
and every caller asks :func:`inequivalent` or :func:`invalid_arg`: a refusal that came as a
:class:`~amqp_locks.errors.PreconditionFailed` was read when it arrived
(transport/errors.py) and carries the fields, so asking it reads no text again. The
wording, the same on 3.10.8 and 4.3.6 (tests/data/refusals.json, captured from both), is RabbitMQ's
``rabbit_misc:assert_args_equivalence``::

    PRECONDITION_FAILED - inequivalent arg 'A' for queue 'Q' in vhost 'V':
      received 'X' but current is 'Y'                         (both have the argument)
      received none but current is the value 'Y' of type 'T'  (and the reverse)
    PRECONDITION_FAILED - invalid arg 'A' for queue 'Q' in vhost 'V': {value_negative,-1}

RabbitMQ cuts a reply text to 252 bytes and "...": a long queue name can cut off the
values, so an ``inequivalent arg`` refusal is still recognised (:attr:`Inequivalent.read`
False).
"""

from __future__ import annotations

import re

from ..errors import Inequivalent, PreconditionFailed

__all__ = ["Inequivalent", "inequivalent", "invalid_arg"]

_ARG = re.compile(r"inequivalent arg '(?P<arg>[^']+)'")
_WHOLE = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for queue .*?: received (?P<received>.*?) but current is "
    r"(?:(?P<none>none)|(?:the value )?'(?P<value>[^']*)')"
)
_VALUE = re.compile(r"(?:the value )?'(?P<value>[^']*)'")
_INVALID = re.compile(r"invalid arg '(?P<arg>[^']+)'")


def inequivalent(error: BaseException | str) -> Inequivalent | None:
    """What the 406 `error` (an exception or its text) says differs; None when it is not
    an "inequivalent arg" refusal."""
    if isinstance(error, PreconditionFailed):
        return error.refusal
    text = str(error)
    whole = _WHOLE.search(text)
    if whole is not None:
        received = whole["received"]
        value = None if received == "none" else _VALUE.match(received)
        return Inequivalent(
            whole["arg"],
            current=None if whole["none"] else whole["value"],
            received=None if value is None else value["value"],
            read=True,
        )
    start = _ARG.search(text)
    return None if start is None else Inequivalent(start["arg"])


def invalid_arg(error: BaseException | str) -> str | None:
    """The argument a 406 "invalid arg" refusal names, else None: a value the broker never
    takes (``x-max-length: -1``) sent for a queue it would have to make (it is missing)."""
    if isinstance(error, PreconditionFailed):
        return error.invalid_arg
    m = _INVALID.search(str(error))
    return None if m is None else m["arg"]
