"""`amqp-locks broker ...`: the private local RabbitMQ node for development."""

from __future__ import annotations

from pathlib import Path

import click

from .. import devbroker
from .exitcodes import Exit

NODE = click.option(
    "--name",
    default=devbroker.DEFAULT_NAME,
    show_default=True,
    help="Node name (its files live in $AMQP_LOCKS_HOME/broker/NAME).",
)
BASE_DIR = click.option(
    "--base-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Node directory (default: $AMQP_LOCKS_HOME/broker/NAME, else ~/.cache/amqp-locks).",
)


@click.group(
    epilog="""\b
Examples:
  amqp-locks broker start            # prints the URL
  export AMQP_URL=$(amqp-locks broker url)
  amqp-locks broker status || echo not running
  amqp-locks broker stop"""
)
def broker() -> None:
    """The private RabbitMQ node on 127.0.0.1 used when no --url/$AMQP_URL is given."""


@broker.command("start")
@NODE
@BASE_DIR
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="AMQP port.")
@click.option("--wait", type=click.FloatRange(min=1), default=60.0, show_default=True)
def start(name: str, base_dir: Path | None, port: int | None, wait: float) -> None:
    """Start the node (idempotent) and print its AMQP URL."""
    click.echo(devbroker.start(name, base_dir, port, wait).url)


@broker.command("stop")
@NODE
@BASE_DIR
def stop(name: str, base_dir: Path | None) -> None:
    """Stop the node if it runs."""
    stopped = devbroker.stop(name, base_dir)
    click.echo("stopped" if stopped else "not running")


@broker.command("status")
@NODE
@BASE_DIR
def status(name: str, base_dir: Path | None) -> int:
    """Print the URL if the node runs (exit 0), else 'not running' (exit 3)."""
    info = devbroker.status(name, base_dir)
    if info is None:
        click.echo("not running")
        return Exit.NOT_RUNNING
    click.echo(info.url)
    return Exit.OK


@broker.command("url")
@NODE
@BASE_DIR
def url(name: str, base_dir: Path | None) -> None:
    """Print the node's AMQP URL, starting it if needed."""
    click.echo(devbroker.url(name, base_dir))
