"""Every `amqp-locks` command line in README.md's and docs/'s shell, cron and unit-file
blocks, and among the examples of its own `--help`, parses as the command stands: its
subcommand, options and arguments exist and take the values shown, so a renamed option
cannot leave a recipe behind. (The ```python examples run whole:
tests/test_doc_examples.py.) A recipe's COMMAND (`./deploy.sh`) and hosts (`mq.internal`)
are the reader's, so these lines are parsed, not run; what each command does is tested in
this folder's other files.

A line is a command when its first word is `amqp-locks` (or a path ending in it), after a
`$ ` prompt, a cron schedule's five fields or a unit file's `ExecStart=`; a trailing `\\`
joins the next line. `[...]` marks an optional part: the line is parsed with and without
each one. The synopsis (`[-v|-vv] ... COMMAND ...`) is no command: SYNOPSES counts them.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from amqp_locks.cli import EPILOG, cli

from ..test_doc_examples import DOCS, OPENING, ROOT, _fenced

#: Synopsis lines (metavariables, alternatives), by file: a new one must be added here.
SYNOPSES = {"docs/cli.md": 1}
#: What comes before the command on its line: a prompt, a cron schedule, a unit file key.
PREFIX = re.compile(r"(\$ |(?:[\d*/,-]+\s+){5}|ExecStart=)?(?=(?:\S*/)?amqp-locks\s)")
OPTIONAL = re.compile(r"\[([^\[\]]*)\]")


@dataclass(frozen=True)
class Line:
    path: str
    line: int  # 1-based, of the command's first line
    text: str  # continuation lines joined

    @property
    def synopsis(self) -> bool:
        return "|" in self.text or "..." in self.text

    def variants(self) -> list[list[str]]:
        """The words of the line with each optional part present or absent."""
        found = []
        for present in itertools.product((True, False), repeat=len(OPTIONAL.findall(self.text))):
            keep = iter(present)  # one choice per optional part, in order
            text = OPTIONAL.sub(lambda m, keep=keep: m.group(1) if next(keep) else "", self.text)
            found.append(shlex.split(text, comments=True)[1:])  # less the program's name
        return found


def command_lines(path: Path) -> Iterator[Line]:
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not OPENING.fullmatch(lines[i]):
            i += 1
            continue
        end = _fenced(lines, i)[1]
        if lines[i].rstrip() != "```python":
            yield from _block_commands(rel, lines, i + 1, end)
        i = end + 1


def _block_commands(rel: str, lines: list[str], start: int, end: int) -> Iterator[Line]:
    """The command lines among `lines[start:end]`, one fenced block's body."""
    # a block with `$ ` prompts is a session: its other lines are the output
    session = any(line.startswith("$ ") for line in lines[start:end])
    k = start
    while k < end:
        first = k
        match = PREFIX.match(lines[k])
        text = lines[k]
        while text.rstrip().endswith("\\") and k + 1 < end:
            k += 1
            text = text.rstrip()[:-1] + " " + lines[k].strip()
        k += 1
        if match is not None and (not session or lines[first].startswith("$ ")):
            yield Line(rel, first + 1, text[match.end() :])


def help_lines() -> Iterator[Line]:
    """The examples at the end of `amqp-locks --help`."""
    for number, text in enumerate(EPILOG.splitlines(), 1):
        if text.startswith("  amqp-locks "):
            yield Line("amqp-locks --help", number, text.strip())


ALL = [line for path in DOCS for line in command_lines(path)] + list(help_lines())
COMMANDS = [line for line in ALL if not line.synopsis]


def test_the_docs_have_command_lines_and_their_synopses_are_counted() -> None:
    assert Counter(line.path for line in ALL if line.synopsis) == SYNOPSES
    # README's quick list, the recipes, the administration list, status, --help's
    # examples: 38 when written
    assert len(COMMANDS) >= 38, [line.text for line in COMMANDS]
    assert sum(line.path == "amqp-locks --help" for line in COMMANDS) >= 6


def parse(words: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """Parse `words` as `amqp-locks` does, every option's callback and type included, with
    the commands' bodies replaced: the leaf command's path and its parameters."""
    ran: list[tuple[str, dict[str, Any]]] = []

    def replace(command: click.Command, path: str) -> None:
        def record(**params: Any) -> None:
            ran.append((path, params))

        if isinstance(command, click.Group):
            monkeypatch.setattr(command, "callback", lambda **_: None)
            for name, sub in command.commands.items():
                replace(sub, f"{path} {name}")
        else:
            monkeypatch.setattr(command, "callback", record)

    replace(cli, "amqp-locks")
    for name in [n for n in os.environ if n.startswith("AMQP_LOCKS_")]:
        monkeypatch.delenv(name)  # only the line's own words
    try:
        cli.main(args=words, prog_name="amqp-locks", standalone_mode=False)
    except click.ClickException as exc:
        raise AssertionError(f"{' '.join(words)!r}: {exc.format_message()}") from exc
    assert len(ran) == 1, ran
    return ran[0]


@pytest.mark.parametrize("line", COMMANDS, ids=lambda line: f"{line.path}:{line.line}")
def test_each_documented_command_parses(line: Line, monkeypatch: pytest.MonkeyPatch) -> None:
    for words in line.variants():
        path, params = parse(words, monkeypatch)
        ours = words[: words.index("--")] if "--" in words else words
        subcommands = iter(ours)  # the leaf's path, in order, among the line's own words
        assert all(name in subcommands for name in path.split()[1:]), (path, words)
        if "--" in words:  # COMMAND reaches run/elect whole
            assert list(params["command"]) == words[words.index("--") + 1 :]


def test_a_renamed_option_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above could fail: an option the command does not have is refused."""
    words = ["run", "deploys", "-n", "3", "--wait-for", "600", "--", "./deploy.sh"]
    with pytest.raises(AssertionError, match="No such option '--wait-for'"):
        parse(words, monkeypatch)
    with pytest.raises(AssertionError, match="'three' is not a valid integer"):
        parse(["run", "deploys", "-n", "three", "--", "./deploy.sh"], monkeypatch)
