"""`amqp-locks run`: the real command, in subprocesses, against the test broker."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from amqp_locks_dev import devbroker

from .conftest import Cli, close_connections_of


def test_twenty_runs_never_exceed_three_slots(cli: Cli, name: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    # A holder that starts before the third waits (30 s at most) until three have started,
    # so the three slots are seen full on every run, however the 20 starts spread out.
    script = (
        f'echo "start $$ $AMQP_LOCKS_SLOT" >> {log}; n=0; '
        f'while [ "$(grep -c ^start {log})" -lt 3 ] && [ $n -lt 600 ]; do '
        f'sleep 0.05; n=$((n+1)); done; sleep 0.1; echo "end $$" >> {log}'
    )
    procs = [
        subprocess.Popen(
            cli.argv(["run", name, "-n", "3", "-c", script]),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(20)
    ]
    errors = [p.communicate(timeout=90)[1] for p in procs]
    failed = [(i, p.returncode, errors[i]) for i, p in enumerate(procs) if p.returncode]
    # each failed run's exit code and its whole stderr (rehearsal 13: one of 20 exited 69
    # at load ~9, and pytest's cut-short list showed only the empty ones)
    assert not failed, failed

    lines = log.read_text().splitlines()
    assert len(lines) == 40
    running: dict[str, str] = {}
    most = 0
    for line in lines:
        word, pid, *rest = line.split()
        if word == "start":
            assert pid not in running
            slot = rest[0]
            assert slot in {"1", "2", "3"}
            assert slot not in running.values(), f"slot {slot} held twice: {lines}"
            running[pid] = slot
            most = max(most, len(running))
        else:
            del running[pid]
    assert not running
    assert most == 3, f"the three slots were never held at once: {lines}"
    # Created by the first comer, with 3 slots, and nothing left held.
    status = cli.run("semaphore", "max", name)
    assert status.stdout.strip() == "3"


def test_nonblock_and_wait_exit_codes(cli: Cli, name: str) -> None:
    holder = cli.start("run", name, "-c", "echo held; exec sleep 60")
    holder.expect("held")

    t0 = time.monotonic()
    busy, busy42, timed = cli.run_many(
        ["run", name, "--nonblock", "--", "echo", "ran"],
        ["run", name, "--nonblock", "-E", "42", "--", "true"],
        ["run", name, "-w", "1", "-E", "3", "--", "echo", "ran"],
    )
    assert busy.returncode == 1
    assert "ran" not in busy.stdout
    assert busy.stderr.count("\n") == 1 and "not obtained" in busy.stderr
    assert busy42.returncode == 42
    assert timed.returncode == 3
    assert time.monotonic() - t0 >= 1.0
    assert "ran" not in timed.stdout

    holder.popen.send_signal(signal.SIGTERM)
    assert holder.finish()[0] == 128 + signal.SIGTERM
    free = cli.run("run", name, "--nonblock", "--", "echo", "ran")
    assert free.returncode == 0 and free.stdout == "ran\n"


def test_waiter_gets_the_lock_when_holder_ends(cli: Cli, name: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    holder = cli.start("run", name, "-c", f"echo held; while [ ! -e {gate} ]; do sleep 0.05; done")
    holder.expect("held")
    waiter = cli.start("run", name, "-w", "30", "--", "echo", "second")
    gate.touch()
    assert holder.finish()[0] == 0
    rc, out, _ = waiter.finish()
    assert (rc, out) == (0, "second")


def test_child_status_environment_and_exec_errors(cli: Cli, name: str) -> None:
    env_line = 'echo "$AMQP_LOCKS_NAME $AMQP_LOCKS_KIND $AMQP_LOCKS_SLOT $AMQP_LOCKS_FENCING_TOKEN"'
    # Independent locks, so the calls can run at once.
    status7, killed, env, missing, not_exec = cli.run_many(
        ["run", name + "a", "--", "sh", "-c", "exit 7"],
        ["run", name + "b", "-c", "kill -KILL $$"],
        ["run", name, "-n", "2", "-c", env_line],
        ["run", name + "c", "--", "no-such-command-xyz"],
        ["run", name + "d", "--", "/"],
    )
    assert status7.returncode == 7
    assert killed.returncode == 128 + signal.SIGKILL
    assert env.returncode == 0
    got_name, kind, slot, token = env.stdout.split()
    assert (got_name, kind, slot) == (name, "semaphore", "1")
    assert int(token) >= 1
    assert missing.returncode == 127
    assert missing.stderr.strip().endswith("no-such-command-xyz: command not found")
    assert missing.stderr.count("\n") == 1
    assert not_exec.returncode == 126

    again, free_c, free_d = cli.run_many(
        ["run", name, "-c", 'echo "$AMQP_LOCKS_FENCING_TOKEN"'],
        # The lock was released after the failed exec: it is free.
        ["run", name + "c", "--nonblock", "--", "true"],
        ["run", name + "d", "--nonblock", "--", "true"],
    )
    assert int(again.stdout) > int(token)  # fencing tokens rise with every grant
    assert free_c.returncode == free_d.returncode == 0


def test_bad_input_exit_codes(cli: Cli, name: str) -> None:
    bad_password = cli.url.replace("guest:guest@", "guest:wrong@")
    *usage, unknown, unreachable, denied = cli.run_many(
        ["run", "amq.reserved", "--", "true"],
        ["run", name, "-n", "0", "--", "true"],
        ["run", name, "--nonblock", "-w", "1", "--", "true"],
        ["run", name],
        ["run", name + ".mutex", "--", "true"],
        ["run", name, "--kind", "persistent", "--", "true"],
        ["--url", "amqp://guest:guest@127.0.0.1:1/", "run", name, "--", "true"],
        ["--url", bad_password, "run", name, "--", "true"],
    )
    for r in usage:
        assert r.returncode == 64, (r.args, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr
    assert unknown.returncode == 65
    assert "does not exist" in unknown.stderr and unknown.stderr.count("\n") == 1
    assert unreachable.returncode == 69
    assert unreachable.stderr.count("\n") == 1
    assert denied.returncode == 77
    assert denied.stderr.count("\n") == 1 and "wrong" not in denied.stderr


def test_sigterm_is_forwarded_to_the_command(cli: Cli, name: str) -> None:
    p = cli.start(
        "run",
        name,
        "-c",
        'trap "echo got-TERM; exit 7" TERM; echo ready; while :; do sleep 0.05; done',
    )
    p.expect("ready")
    p.popen.send_signal(signal.SIGTERM)
    rc, out, _ = p.finish()
    assert rc == 7
    assert "got-TERM" in out
    assert cli.run("run", name, "--nonblock", "--", "true").returncode == 0


def test_a_signal_the_moment_the_command_starts_is_forwarded(cli: Cli, name: str) -> None:
    """The command signals `amqp-locks` first thing, as early as a signal can come after
    the spawn: forwarding is in place from before COMMAND starts (it used to be installed
    after, and a SIGTERM in between killed `amqp-locks` itself: exit -15, seen in CI under
    load)."""
    command = 'trap "exit 7" TERM; kill -TERM $PPID; while :; do sleep 0.05; done'
    for _ in range(20):
        r = cli.run("run", name, "-c", command)
        assert r.returncode == 7, r.stderr


def test_removed_slot_stops_the_command(cli: Cli, name: str, tmp_path: Path) -> None:
    # The command ignores SIGTERM, so only the SIGKILL after --grace stops it; its child
    # (sleep) is in the same process group and must go too.
    pidfile = tmp_path / "pid"
    p = cli.start(
        "run",
        name,
        "-n",
        "1",
        "--grace",
        "1",
        "-c",
        f'trap "" TERM; sleep 60 & echo $! > {pidfile}; echo ready; wait',
    )
    p.expect("ready")
    t0 = time.monotonic()
    assert cli.run("semaphore", "remove", name, "1").returncode == 0
    rc, _, err = p.finish()
    assert rc == 75
    assert "lost" in err
    assert time.monotonic() - t0 < 10
    grandchild = int(pidfile.read_text())
    _assert_gone(grandchild)


def test_deleted_mutex_queue_stops_the_command(
    cli: Cli, name: str, node: devbroker.NodeInfo
) -> None:
    p = cli.start("run", name, "--grace", "5", "-c", "echo ready; exec sleep 60")
    p.expect("ready")
    devbroker.rabbitmqctl(node, "delete_queue", name)
    rc, _, err = p.finish()
    assert rc == 75
    assert f"lock {name!r} lost" in err


def test_closed_connection_stops_the_command(cli: Cli, name: str, node: devbroker.NodeInfo) -> None:
    p = cli.start("run", name, "--lost-exit-code", "99", "-c", "echo ready; exec sleep 60")
    p.expect("ready")
    assert close_connections_of(node, p.popen.pid) == 1
    rc, _, err = p.finish()
    assert rc == 99
    assert err.count("\n") == 0 and "lost" in err  # one line


def _assert_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A zombie still answers kill(0); it is dead enough once its state says so.
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} survived the lost lock")
