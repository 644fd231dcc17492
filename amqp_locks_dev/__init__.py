"""Development tooling for amqp-locks: private RabbitMQ, PostgreSQL and MariaDB servers on
loopback for the demo, the tests and the benchmarks.

Not part of the library and not shipped in its wheel: the library never starts a server or
installs a package. These modules do both, on purpose, and only when a script, a test or a
benchmark of this repository asks them to (``scripts/broker``, ``scripts/db``,
``scripts/cluster``, ``scripts/demo``, ``tests/``, ``benchmarks/``).
"""
