"""Issue 13: -n mismatches refused, the wait line on a terminal, warnings on stderr by
default, AMQP_LOCKS_* variables, global options after the subcommand, and the `--` hint."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

from .conftest import CMD, Cli, child_env, signal_a_thread


def _on_terminal(
    argv: Sequence[str], env: dict[str, str], timeout: float = 30.0, term_on: str | None = None
) -> tuple[int, str]:
    """Run with stderr on a pseudo-terminal (stdout a pipe): (status, what the terminal
    got). With `term_on`, SIGTERM is sent once the terminal shows that text (so the
    signal finds the program where the text says it is, however slowly it started)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**env, "TERM": "xterm", "COLUMNS": "200"},
    )
    os.close(slave)
    got = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed its end
                    break
                if not chunk:
                    break
                got += chunk
                if term_on is not None and term_on.encode() in got:
                    proc.send_signal(signal.SIGTERM)
                    term_on = None
            elif proc.poll() is not None:
                break
        return proc.wait(timeout), got.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- 1. -n that disagrees with the existing lock ------------------------------------------------


def test_slots_that_disagree_with_the_existing_lock_are_refused(cli: Cli, name: str) -> None:
    assert cli.run("semaphore", "create", name, "5").returncode == 0
    assert cli.run("token", "setup", name + "t", "2").returncode == 0
    fewer, same, tokens, same_tokens, priority = cli.run_many(
        ["run", name, "-n", "3", "--", "echo", "ran"],
        ["run", name, "-n", "5", "--", "echo", "ran"],
        ["run", name + "t", "--kind", "token", "-n", "3", "--", "echo", "ran"],
        ["run", name + "t", "--kind", "token", "-n", "2", "--", "echo", "ran"],
        ["run", name + "m", "--priority", "5", "--", "echo", "ran"],
    )
    assert fewer.returncode == 65 and fewer.stdout == ""
    assert fewer.stderr == (
        f"amqp-locks: error: semaphore {name!r} has 5 slots, not 3 (-n 3): change its "
        f"count with 'amqp-locks semaphore add|remove {name} COUNT', or leave out -n\n"
    )
    assert (same.returncode, same.stdout) == (0, "ran\n")
    assert tokens.returncode == 65 and tokens.stdout == ""
    assert f"token semaphore '{name}t' has 2 permits, not 3" in tokens.stderr
    assert tokens.stderr.count("\n") == 1
    assert (same_tokens.returncode, same_tokens.stdout) == (0, "ran\n")
    assert priority.returncode == 64 and "--priority" in priority.stderr
    assert cli.run("semaphore", "max", name).stdout == "5\n"  # untouched


# --- 2. the wait line -----------------------------------------------------------------------------


def test_wait_line_on_a_terminal_only(cli: Cli, name: str) -> None:
    holder = cli.start(
        "run", name, "-n", "1", "--holder-id", "build-7", "-c", "echo held; exec sleep 60"
    )
    holder.expect("held")
    # Waits long enough for a loaded machine to connect first (a wait that ends before
    # any connection was made is exit 69, not "lock not obtained").
    waiter = cli.argv(["run", name, "--kind", "semaphore", "-w", "6.5", "--", "true"])

    rc, screen = _on_terminal(waiter, child_env())
    assert rc == 1
    assert f"waiting for semaphore {name!r}, " in screen
    # elapsed of the timeout; who holds what, as the holder answered
    who = f"slot 1 held by build-7 (host {socket.gethostname()}, pid {holder.popen.pid}) since "
    assert f"of 6s; {who}" in screen
    assert "(1 of 1 slot(s))" in screen
    assert "lock not obtained" in screen

    rc, screen = _on_terminal(
        cli.argv(["run", name, "--kind", "semaphore", "-w", "5", "-q", "--", "true"]), child_env()
    )
    assert (rc, screen) == (1, "")  # -q: nothing at all

    piped = cli.run(
        "run", name, "--kind", "semaphore", "-w", "5", "--", "true"
    )  # stderr not a terminal
    assert piped.returncode == 1
    assert piped.stderr == f"amqp-locks: {name}: lock not obtained (timed out after 5s)\n"

    holder.popen.send_signal(signal.SIGTERM)
    holder.finish()


def test_wait_line_names_mutex_and_token_holders(cli: Cli, name: str) -> None:
    assert cli.run("token", "setup", name + "t", "1").returncode == 0
    mutex = cli.start("run", name, "--holder-id", "w-m", "-c", "echo held; exec sleep 60")
    token = cli.start(
        "run", name + "t", "--kind", "token", "--holder-id", "w-t", "-c", "echo held; exec sleep 60"
    )
    mutex.expect("held")
    token.expect("held")
    host = socket.gethostname()
    rc, screen = _on_terminal(cli.argv(["run", name, "-w", "6", "--", "true"]), child_env())
    assert rc == 1
    assert (
        f"waiting for mutex {name!r}, " in screen
        and f"; held by w-m (host {host}, pid {mutex.popen.pid}) since " in screen
    )
    rc, screen = _on_terminal(
        cli.argv(["run", name + "t", "--kind", "token", "-w", "6", "--", "true"]), child_env()
    )
    assert rc == 1
    assert f"; permit 1 held by w-t (host {host}, pid {token.popen.pid}) since " in screen
    assert "(1 of 1 permit(s) held), 1 waiting" in screen
    for h in (mutex, token):
        h.popen.send_signal(signal.SIGTERM)
        h.finish()


def test_elect_standby_line_on_a_terminal(cli: Cli, name: str) -> None:
    # The COMMAND outlives the test's patience by far: only a forwarded SIGTERM ends it.
    master = cli.start("elect", name, "--interval", "0.5", "-c", "echo master; exec sleep 600")
    master.expect("master")
    # SIGTERM once the standby line names the holder: a fixed 3 s (`timeout 3`) killed
    # the program before its handlers were set while 4 lanes loaded 2 cores (rc 143), and
    # the line's first second shows no holder yet (its probe asks the holder, which a
    # starved machine answered only after the line's first draws).
    holder = f"held by {socket.gethostname()}:{master.popen.pid} since "
    rc, screen = _on_terminal(cli.argv(["elect", name, "--", "true"]), child_env(), term_on=holder)
    assert rc == 0  # stopped by SIGTERM while standby
    assert f"standby for amqp lock {name!r}, " in screen
    assert holder in screen
    master.popen.send_signal(signal.SIGTERM)
    assert master.finish(timeout=60.0)[0] == 0  # a loaded machine's stop takes its time


def test_elect_stops_on_sigterm_taken_by_another_thread(cli: Cli, name: str) -> None:
    """CI rehearsal 62: SIGTERM taken by one of the master's service threads (the kernel
    hands a process's signal to any thread that does not block it) never ran its handler,
    the main thread being in Thread.join() with no timeout; the master ran on. Sent to such
    a thread on purpose, it stops the master (COMMAND stopped, exit 0)."""
    master = cli.start("elect", name, "--interval", "60", "-c", "echo master; exec sleep 600")
    master.expect("master")
    signal_a_thread(master.popen.pid, signal.SIGTERM)
    rc, _, err = master.finish(timeout=30.0)
    assert rc == 0, err
    assert f"elect {name}: stopping; stopping COMMAND" in err


# --- 3. warnings visible by default --------------------------------------------------------------


def _lease_db_elect(name: str, port: int) -> list[str]:
    url = f"postgresql+psycopg://nobody@127.0.0.1:{port}/nothing"
    return ["elect", name, "--locker", "lease-database", "--db-url", url, "--interval", "0.3"]


def test_library_warnings_are_shown_by_default(cli: Cli, name: str) -> None:
    args = _lease_db_elect(name, _free_port())
    p = cli.start(*args, "--", "echo", "master")
    line = p.expect("database unavailable while standing by", which="err")
    assert line.startswith("amqp-locks: warning: LeaseDatabaseLocker(")
    p.popen.send_signal(signal.SIGTERM)
    rc, out, err = p.finish()
    assert rc == 0 and out == ""
    assert "Traceback" not in err
    assert all(line.startswith("amqp-locks: ") for line in err.splitlines()), err

    # Quiet through several failed attempts: a listener on the database's port counts
    # them (each connection closed at once, so the locker finds the database unavailable).
    with socket.socket() as db:
        db.bind(("127.0.0.1", 0))
        db.listen(8)
        db.settimeout(30)
        quiet = cli.start("-q", *_lease_db_elect(name, db.getsockname()[1]), "--", "echo", "x")
        for _ in range(3):
            conn, _ = db.accept()  # TimeoutError if the locker never tries
            conn.close()
    quiet.popen.send_signal(signal.SIGTERM)
    rc, out, err = quiet.finish()
    assert (rc, out, err) == (0, "", "")


# --- 4. AMQP_LOCKS_* variables ----------------------------------------------------------------


def test_options_from_environment_variables(cli: Cli, name: str) -> None:
    env = child_env(AMQP_LOCKS_URL=cli.url, AMQP_LOCKS_HEARTBEAT="3", AMQP_LOCKS_RUN_SLOTS="3")

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CMD, *args], capture_output=True, text=True, timeout=60, env={**env, **extra}
        )

    made = run("run", name, "--", "sh", "-c", 'echo "$AMQP_LOCKS_KIND"')
    assert (made.returncode, made.stdout) == (0, "semaphore\n"), made.stderr
    assert run("semaphore", "max", name).stdout == "3\n"
    # AMQP_URL still works; AMQP_LOCKS_URL wins over it.
    legacy = run("semaphore", "max", name, AMQP_LOCKS_URL="", AMQP_URL=cli.url)
    assert legacy.stdout == "3\n", legacy.stderr
    # The command line wins over the environment.
    assert run("run", name, "-n", "5", "--", "true").returncode == 65
    helped = run("run", "--help")
    for var in ("AMQP_LOCKS_RUN_WAIT", "AMQP_LOCKS_RUN_NONBLOCK", "AMQP_LOCKS_RUN_SLOTS"):
        assert var in helped.stdout
    assert "AMQP_LOCKS_URL, AMQP_URL" in run("--help").stdout


# --- 5. global options after the subcommand --------------------------------------------------


def test_global_options_after_the_subcommand(cli: Cli, name: str) -> None:
    env = child_env()  # no AMQP_URL: the URL only from the command line
    dead = "amqp://guest:guest@127.0.0.1:1/"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60, env=env)

    after = run("run", name, "--url", cli.url, "--heartbeat", "3", "--", "echo", "after")
    assert (after.returncode, after.stdout) == (0, "after\n"), after.stderr
    before = run("--url", cli.url, "run", name, "--", "echo", "before")
    assert (before.returncode, before.stdout) == (0, "before\n"), before.stderr
    override = run("--url", dead, "run", name, "--url", cli.url, "--", "echo", "later")
    assert override.stdout == "later\n", override.stderr  # the later one wins
    nested = run("semaphore", "create", name + "s", "2", "--url", cli.url)
    assert nested.stdout == "2\n", nested.stderr

    holder = cli.start("run", name, "-c", "echo held; exec sleep 60")
    holder.expect("held")
    loud, quiet = (
        run("run", name, "--nonblock", "--url", cli.url, *q, "--", "true") for q in ([], ["-q"])
    )
    assert loud.returncode == quiet.returncode == 1
    assert "not obtained" in loud.stderr and quiet.stderr == ""
    holder.popen.send_signal(signal.SIGTERM)
    holder.finish()


# --- 6. COMMAND options without `--` ---------------------------------------------------------


def test_command_options_need_dashdash_with_a_hint() -> None:
    env = child_env(AMQP_URL="amqp://guest:guest@127.0.0.1:1/")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60, env=env)

    ls = run("run", "backup", "ls", "-l")
    assert ls.returncode == 64
    assert ls.stderr == (
        "amqp-locks: error: No such option: -l; did you mean: amqp-locks run backup -- ls -l\n"
    )
    ours = run("run", "backup", "-n", "2", "sleep", "-w", "5")  # -w is ours, or sleep's?
    assert ours.returncode == 64 and ours.stderr.count("\n") == 1
    assert "did you mean: amqp-locks run backup -n 2 -- sleep -w 5" in ours.stderr
    elect = run("elect", "sched", "--locker", "amqp", "./sched", "--serve")
    assert elect.returncode == 64
    assert "did you mean: amqp-locks elect sched --locker amqp -- ./sched --serve" in elect.stderr
    # With `--` (or -c) COMMAND's options are its own: it gets as far as connecting.
    assert run("run", "backup", "--", "ls", "-l").returncode == 69
    assert run("run", "backup", "-c", "ls -l").returncode == 69
