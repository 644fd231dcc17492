import click


@click.command()
def status() -> None:
    """x"""
