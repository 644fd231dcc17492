"""Exit codes of `amqp-locks` (sysexits.h where one fits; see docs/cli.md).

`run` and `elect` otherwise exit with their COMMAND's status (128 + N when it died of
signal N, as shells report it).
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0
    #: `run`: the lock is busy (`--nonblock`, or `-w` ran out while the broker answered);
    #: `-E` changes it. A broker that never answered is UNAVAILABLE whatever `-E` says.
    NOT_OBTAINED = 1
    #: A feature of this command needs an extra that is not installed (the message names
    #: it: ``pip install 'amqp-locks[postgresql]'``), or an OS facility this system lacks.
    FEATURE = 2
    #: EX_USAGE: bad option or argument, invalid lock name, SLOTS < 1.
    USAGE = 64
    #: EX_DATAERR: the lock does not exist (unknown semaphore or token semaphore), or its
    #: state conflicts with the request (created with another count, other queue flags),
    #: or an audit found missing/surplus tokens.
    DATAERR = 65
    #: EX_UNAVAILABLE: broker unreachable or silent (no connection within `-w` or the
    #: connect timeout), connection lost, database unavailable.
    UNAVAILABLE = 69
    #: EX_SOFTWARE: a bug (unexpected exception); run with -v for the traceback.
    SOFTWARE = 70
    #: EX_TEMPFAIL: `run`: the lock was lost while COMMAND ran (COMMAND was stopped);
    #: admin commands: the administration mutex or a wait timed out. Retrying may work.
    TEMPFAIL = 75
    #: EX_PROTOCOL: the lock's queue (or its token) says another shape than this client
    #: gives: another kind of lock, another permit count, or a lock delay shorter than its
    #: quorum_timeout needs (LockShapeMismatch; the message names both values and the fix).
    SHAPE = 76
    #: EX_NOPERM: bad credentials, or no permission on the vhost/queue.
    NOPERM = 77
    #: EX_CONFIG: the `--config` file of `elect` is missing or invalid.
    CONFIG = 78
    #: COMMAND exists but cannot be executed (permission, not a binary).
    NOT_EXECUTABLE = 126
    #: COMMAND not found.
    NOT_FOUND = 127
    #: Interrupted (SIGINT) before COMMAND started.
    INTERRUPTED = 130
