"""The optional dependencies: which extra brings what, and the one-line error naming it.

The plain install (``pip install amqp-locks``) has the locks, the asyncio facade, the
AMQP locker and the command line. Everything else is an extra, imported only where it is
used, so a missing one costs nothing until that feature is asked for; then the error
(:class:`~amqp_locks.errors.FeatureUnavailable`, an ``ImportError``) says in one line
which extra to install, and the command line exits with status 2, never a traceback.
"""

from __future__ import annotations

import importlib.util

from .errors import FeatureUnavailable

#: The extras of pyproject.toml and what each one enables (tests/test_extras.py checks
#: the two agree, and scripts/matrix smoke-tests each one alone).
EXTRAS = {
    "sqlite": "the database lockers on SQLite (SQLAlchemy)",
    "postgresql": "the database lockers on PostgreSQL (SQLAlchemy, psycopg 3)",
    "mysql": "the database lockers on MariaDB/MySQL (SQLAlchemy, PyMySQL)",
    "metrics": "Prometheus metrics (prometheus-client)",
    "tooz": "the tooz driver (tooz)",
    "celery": "Celery tasks that hold a lock while they run, amqp_locks.celery (celery)",
    "otel": "OpenTelemetry traces and metrics, amqp_locks.otel (opentelemetry-api, "
    "opentelemetry-instrumentation)",
}

#: Database dialect -> (the extra for it, the driver that extra installs, its module).
_DIALECTS = {
    "sqlite": ("sqlite", "pysqlite", "sqlite3"),
    "postgresql": ("postgresql", "psycopg", "psycopg"),
    "mysql": ("mysql", "pymysql", "pymysql"),
    "mariadb": ("mysql", "pymysql", "pymysql"),
}


def install_hint(extra: str) -> str:
    """``pip install 'amqp-locks[EXTRA]'``: what every message about an extra ends with."""
    return f"pip install 'amqp-locks[{extra}]'"


def unavailable(what: str, extra: str) -> FeatureUnavailable:
    """The error for `what` (a feature) when its `extra` is not installed."""
    return FeatureUnavailable(f"{what} needs the {extra!r} extra: {install_hint(extra)}")


def installed(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or set to None
        return False


def database_extra(url: str) -> str | None:
    """The extra for a SQLAlchemy URL's dialect (None: a dialect we ship no extra for)."""
    dialect = url.split("://", 1)[0].split("+", 1)[0].lower()
    entry = _DIALECTS.get(dialect)
    return entry[0] if entry else None


def require_database(url: str) -> None:
    """Raise FeatureUnavailable naming the extra of `url`'s dialect when SQLAlchemy is not
    installed; a URL of a dialect we ship no extra for is left to SQLAlchemy to judge."""
    if installed("sqlalchemy"):
        return
    extra = database_extra(url)
    if extra is None:
        raise unavailable("a database locker (SQLAlchemy)", "postgresql")
    raise unavailable(f"a database locker on {url.split('://', 1)[0]}:// (SQLAlchemy)", extra)


def missing_driver(url: str, exc: ImportError) -> FeatureUnavailable:
    """SQLAlchemy could not import the DBAPI driver of `url`: name the extra that brings
    one, and the URL form that uses it when the URL asks for another driver."""
    scheme = url.split("://", 1)[0].lower()
    dialect, _, driver = scheme.partition("+")
    entry = _DIALECTS.get(dialect)
    module = getattr(exc, "name", None) or str(exc)
    if entry is None:
        return FeatureUnavailable(
            f"the database driver for {scheme}:// is not installed ({module})"
        )
    extra, ours, _ = entry
    if driver and driver != ours:
        return FeatureUnavailable(
            f"the driver {driver!r} of {scheme}:// is not installed ({module}); "
            f"{install_hint(extra)} brings {ours!r}: use {dialect}+{ours}://"
        )
    if not driver and dialect != "sqlite":
        return FeatureUnavailable(
            f"{dialect}:// means SQLAlchemy's default driver, which is not installed "
            f"({module}); {install_hint(extra)} and use {dialect}+{ours}://"
        )
    return unavailable(f"a database locker on {scheme}://", extra)
