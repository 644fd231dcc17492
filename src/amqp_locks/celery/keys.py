"""Which calls of a task are "the same": the lock name of a call.

The producer (``once``) and the worker must compute the same name from the same call,
although the worker sees the arguments after a trip through the message serializer
(tuples become lists, datetimes come back as datetimes or strings): the arguments are
bound to the task's signature (so ``f(1)``, ``f(a=1)`` and a default all agree) and
written as canonical JSON (sorted keys, ``str()`` of anything else) before hashing.
A value whose ``str()`` is its memory address (an object of a class without its own
``__repr__``/``__str__``, a function) is refused with :class:`UnidentifiableKey`: equal
values would never share a key, and the worker, another process, would compute another
name than the producer.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError

#: What ``lock_key`` may be: None (the task and all its arguments), argument names, or a
#: callable of the task's arguments whose result is the key (shared across tasks).
LockKey = Sequence[str] | Callable[..., Any] | None

PREFIX = "celery."
#: Task names longer than this are hashed too (queue names are at most 255 bytes).
MAX_READABLE = 120


#: The address in a default ``repr``: ``<foo.Bar object at 0x7f...>``, ``<function f at 0x...>``.
_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+>")

HOW_TO_KEY = (
    "give its class a __repr__ that says which value it is, pass an identifying value "
    "instead (an id), or choose the key: lock_key=[other argument names] or a lock_key "
    "callable returning an identifying value (docs/celery.md, lock_key)"
)


class UnidentifiableKey(ConfigurationError):
    """A call's key would hold an object's address (its default ``repr``): refused where
    the key is computed (at enqueue) rather than locking, or deduplicating, per object."""


class _Address(Exception):
    """Raised out of ``json.dumps`` for a value whose text is its address."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def _text(value: Any) -> str:
    text = str(value)
    if _ADDRESS.search(text):
        raise _Address(text)
    return text


def canonical(value: Any) -> str:
    """`value` as JSON that a serializer round trip does not change; :class:`_Address`
    for a value (at any depth) whose ``str()`` is its memory address."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_text)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def parameters(run: Callable[..., Any]) -> list[str]:
    """The argument names of a task's ``run`` (bound: no ``self``)."""
    return list(inspect.signature(run).parameters)


def check_key(key: Any, run: Callable[..., Any] | None) -> LockKey:
    """Refuse a ``lock_key`` that is none of the three kinds, or names unknown arguments."""
    if key is None or callable(key):
        return key  # type: ignore[no-any-return]
    if isinstance(key, str | bytes) or not isinstance(key, Sequence):
        raise ConfigurationError(
            f"lock_key must be None, a list of argument names or a callable, not {key!r} "
            "(one argument: lock_key=['user_id'])"
        )
    names = list(key)
    if not all(isinstance(n, str) for n in names):
        raise ConfigurationError(f"lock_key names must be strings, got {names!r}")
    if run is not None:
        known = parameters(run)
        params = inspect.signature(run).parameters.values()
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        unknown = [n for n in names if n not in known]
        if unknown and not takes_any:
            raise ConfigurationError(
                f"lock_key names {unknown}, which the task does not take (it takes {known})"
            )
    return names


def bound_arguments(
    run: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name, defaults applied (``**kwargs`` flattened in)."""
    try:
        bound = inspect.signature(run).bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigurationError(f"the task's arguments do not fit its signature: {exc}") from exc
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = list(value) if kind is inspect.Parameter.VAR_POSITIONAL else value
    return out


def lock_name(
    task_name: str,
    key: LockKey,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """The lock name of one call: ``celery.<task>.<hash of the selected arguments>``, or
    ``celery.key.<hash of the key>`` for a callable ``lock_key`` (so several tasks may
    share one lock by returning the same key)."""
    if callable(key):
        try:
            return f"{PREFIX}key.{_digest(canonical(key(*args, **kwargs)))}"
        except _Address as exc:
            raise UnidentifiableKey(
                f"{task_name}: the lock_key callable returned {exc.text} (or a value holding "
                "it), an address rather than a value: return a value that says which call "
                "this is (an id, a string)"
            ) from None
    arguments = bound_arguments(run, args, kwargs)
    if key is not None:
        arguments = {n: arguments.get(n) for n in key}
    readable = task_name if len(task_name.encode()) <= MAX_READABLE else _digest(task_name)
    try:
        return f"{PREFIX}{readable}.{_digest(canonical(arguments))}"
    except _Address:
        for argument, value in arguments.items():
            try:
                canonical(value)
            except _Address as exc:
                raise UnidentifiableKey(
                    f"{task_name}: argument {argument!r} is part of the lock key, but its "
                    f"key form is {exc.text}, an address rather than a value: equal values "
                    f"would never share a key; {HOW_TO_KEY}"
                ) from None
        raise  # pragma: no cover - some argument raised above
