"""The README's Getting started, run as it stands, and its scripts' one line for a taken port.

Getting started: the console and sh blocks of README.md's "Getting started on
your own data" are taken apart into their commands (`$ ` lines) and the output
shown under each, and the commands are run in one bash, in order, as a reader
types them: in a directory of the test's own (where `skillstats.db` is made;
`deploy` is linked into it), with `KAFKA_PORT` naming the test broker (for
`deploy/local/kafka.sh bootstrap`) and the topic, DLQ topic and groups set to
this run's own beforehand (SKILLSTATS_TOPIC and the like, as a reader's shell
could have them), so that the run shares nothing with another. Every command
must exit 0, and each line shown under it must be among what it printed, in
order: the defaults read as this run's values, what differs from run to run
(timestamps, dates, durations, the topic's id, a bar's length) read as such,
whitespace runs as one, "..." as anything. A read-only command (`status`, `top`)
whose output has not got there yet is asked again, as a reader a moment later
would see it; a background command's lines are waited for, and it is stopped at
the end (SIGTERM, exit status 0), whether or not the README stops it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Getting started on your own data"
READ_ONLY = ("skillstats status", "skillstats top")  # asked again until their output is there

# What differs from run to run, in the output shown: each a pattern that matches any such value.
VOLATILE = {
    "dots": (r"\.\.\.", r".*"),
    "stamp": (r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"),
    "date": (r"\d{4}-\d{2}-\d{2}", r"\d{4}-\d{2}-\d{2}"),
    "topic_id": (r"\(id [^)\s]+\)", r"\(id [^)\s]+\)"),
    "seconds": (r"\b\d+(?:\.\d+)?s\b", r"\d+(?:\.\d+)?s"),
    "bar": (r"█+", r"█+"),
}
_VOLATILE = re.compile("|".join(f"(?P<{name}>{shown})" for name, (shown, _any) in VOLATILE.items()))


@dataclass
class Step:
    command: str  # as written, comment and trailing "&" removed
    shown: list[str] = field(default_factory=list)  # the output lines the README shows under it
    background: bool = False


def getting_started() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def without_comment(line: str) -> str:
    """`line` up to an unquoted "#" that starts a word: what bash runs of it."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def steps(section: str) -> list[Step]:
    """The section's commands, in order, each with the output lines shown under it."""
    found: list[Step] = []
    for kind, body in re.findall(r"```(console|sh)\n(.*?)```", section, re.DOTALL):
        current: Step | None = None
        for line in body.splitlines():
            command = line[2:] if kind == "console" and line.startswith("$ ") else line if kind == "sh" else None
            if command is not None:
                command = without_comment(command)
                if not command:
                    continue
                background = command.endswith("&") and not command.endswith("&&")
                current = Step(command.removesuffix("&").rstrip(), background=background)
                found.append(current)
            elif current is not None and line.strip() and line.strip() != "...":
                current.shown.append(line)  # a command's output runs to the next command; "..." lines: more
    return found


def expectation(line: str, values: dict[str, str]) -> re.Pattern[str]:
    """A shown line as a pattern: this run's values for the defaults, any value where values differ by run."""
    for default, value in values.items():
        line = line.replace(default, value)
    parts, at = [], 0
    for match in _VOLATILE.finditer(line):
        parts.append(re.escape(line[at : match.start()]))
        parts.append(VOLATILE[match.lastgroup or ""][1])
        at = match.end()
    parts.append(re.escape(line[at:]))
    return re.compile(re.sub(r"(?:\\ |\s)+", r"\\s+", "".join(parts)))


def unmatched(shown: list[str], printed: str, values: dict[str, str]) -> str | None:
    """The first shown line not among the printed ones (after the previous one's), or None."""
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    at = 0
    for line in shown:
        pattern = expectation(" ".join(line.split()), values)
        at = next((i + 1 for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), -1)
        if at < 0:
            return line
    return None


class Shell:
    """One bash, fed a command at a time on stdin, as a reader's terminal is: `export`s and jobs carry over."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.steps = cwd / ".steps"
        self.steps.mkdir()
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=(self.steps / "bash.log").open("w"),
            cwd=cwd,
            env=env,
            text=True,
        )
        self.count = 0
        self.background: list[tuple[str, int]] = []

    def _send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def _finished(self, path: Path) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"bash exited ({self.process.returncode}): {(self.steps / 'bash.log').read_text()}")
        return path.exists()

    def run(self, command: str, timeout: float = 180) -> tuple[int, str]:
        """Run `command` to its end; (exit status, what it printed, stdout and stderr)."""
        self.count += 1
        out, status = self.steps / f"{self.count}.out", self.steps / f"{self.count}.status"
        self._send(
            f'{{ {command}\n}} >"{out}" 2>&1 </dev/null; echo $? >"{status}.tmp"; mv "{status}.tmp" "{status}"\n'
        )
        wait_until(lambda: self._finished(status), timeout, f"`{command}` to finish")
        return int(status.read_text()), out.read_text(errors="replace")

    def start(self, command: str) -> Path:
        """Start `command` in the background (`&`); the file its output goes to."""
        self.count += 1
        out, pid = self.steps / f"{self.count}.out", self.steps / f"{self.count}.pid"
        self._send(f'{command} >"{out}" 2>&1 </dev/null &\necho $! >"{pid}.tmp"; mv "{pid}.tmp" "{pid}"\n')
        wait_until(lambda: self._finished(pid), 30, f"`{command}` to start")
        self.background.append((command, int(pid.read_text())))
        return out

    def stop_background(self) -> dict[str, int]:
        """SIGTERM to every background command still running; each one's exit status, from bash's `wait`."""
        codes = {}
        for command, pid in self.background:
            with contextlib.suppress(ProcessLookupError):  # stopped already (the README's `kill %1`)
                os.kill(pid, signal.SIGTERM)
            codes[command] = self.run(f"wait {pid}", timeout=90)[0]
        return codes

    def close(self) -> None:
        for _command, pid in self.background:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(30)


def run_step(shell: Shell, step: Step, values: dict[str, str]) -> tuple[int, str]:
    """Run a foreground step; a read-only one again (for up to a minute) while its output is not there yet.

    Also while it exits non-zero: `status` exits 1 for a moment now and then, when confluent-kafka hands it a
    group's commit metadata with bytes past its end, read as another database's mark (a bug of
    skillstats/kafka.py's commit_metadata, reported); a command that keeps failing still fails the test."""
    last = [shell.run(step.command)]

    def again() -> bool:
        last[0] = shell.run(step.command)
        return last[0][0] == 0 and unmatched(step.shown, last[0][1], values) is None

    if step.command.startswith(READ_ONLY) and not (
        last[0][0] == 0 and unmatched(step.shown, last[0][1], values) is None
    ):
        with contextlib.suppress(AssertionError):  # the caller's assertions say what differs
            wait_until(again, 60, f"`{step.command}` to print what the README shows")
    return last[0]


def test_the_section_is_read_as_commands_with_their_output() -> None:
    """The parser sees what the README holds: a test that ran nothing would prove nothing."""
    found = steps(getting_started())
    commands = [s.command.split()[:2] for s in found]
    assert ["skillstats", "init"] in commands and ["skillstats", "docsync"] in commands, commands
    assert any(s.background for s in found) and all(s.shown for s in found if s.command.startswith("skillstats ")), [
        (s.command, s.shown) for s in found
    ]
    assert found[0].command.startswith("export SKILLSTATS_KAFKA_BOOTSTRAP=$(deploy/local/kafka.sh bootstrap)")
    registry = next(i for i, s in enumerate(found) if "INSERT INTO skills" in s.command)
    assert registry < next(i for i, s in enumerate(found) if s.command == "skillstats docsync")


def test_getting_started_runs_as_the_readme_shows(kafka_bootstrap: str, tmp_path: Path) -> None:
    if shutil.which("sqlite3") is None:
        pytest.fail("no sqlite3 on PATH: the README's test command installs Debian's sqlite3 package")
    addresses = kafka_bootstrap.split(",")
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    local = all(a.startswith("127.0.0.1:") for a in addresses) and ports == list(range(ports[0], ports[0] + len(ports)))
    assert local, f"{kafka_bootstrap}: the README's `deploy/local/kafka.sh bootstrap` names a local cluster only"
    run = uuid.uuid4().hex[:10]
    topic = f"readme-{run}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKILLSTATS_", "KAFKA_", "PG_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # the virtualenv, as the README says
        KAFKA_PORT=str(ports[0]),
        KAFKA_NODES=str(len(ports)),
        SKILLSTATS_TOPIC=topic,
        SKILLSTATS_DLQ_TOPIC=f"{topic}.dlq",
        SKILLSTATS_WINDOWS_GROUP=f"readme-windows-{run}",
        SKILLSTATS_DOCSYNC_GROUP=f"readme-docsync-{run}",
        SKILLSTATS_METRICS_PORT="0",  # the worker's default 9310 may be another's on a shared machine
    )
    values = {
        "skill-stat-events": topic,
        "skillstats-windows": env["SKILLSTATS_WINDOWS_GROUP"],
        "skillstats-docsync": env["SKILLSTATS_DOCSYNC_GROUP"],
        "127.0.0.1:9092": kafka_bootstrap,
    }
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    shell = Shell(tmp_path, env)
    try:
        for step in steps(getting_started()):
            if step.background:
                out = shell.start(step.command)
                wait_until(
                    lambda out=out, step=step: unmatched(step.shown, out.read_text(errors="replace"), values) is None,
                    120,
                    f"`{step.command}` to print what the README shows: {step.shown}",
                )
                continue
            code, printed = run_step(shell, step, values)
            assert code == 0, f"`{step.command}` exited {code}:\n{printed[-3000:]}"
            missing = unmatched(step.shown, printed, values)
            assert missing is None, f"`{step.command}`: the README shows\n  {missing}\nit printed:\n{printed[-3000:]}"
        assert shell.background, "no background command was run"
        codes = shell.stop_background()
        assert set(codes.values()) == {0}, codes  # SIGTERM: a clean stop
    finally:
        shell.close()


def _script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SKILLSTATS_", "KAFKA_", "PG_"))}
    return subprocess.run(
        [str(ROOT / "deploy" / "local" / name), "start"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("script", "variable", "named"),
    [
        ("postgres.sh", "PG_PORT", {}),
        ("postgres.sh", "PG_PORT", {"PG_PORT_SETTING": "SKILLSTATS_TEST_PG_PORT"}),  # as test.sh runs it
        ("kafka.sh", "KAFKA_PORT", {}),
    ],
)
def test_a_taken_port_is_one_line_naming_the_variable_that_moves_it(
    script: str, variable: str, named: dict[str, str], tmp_path: Path
) -> None:
    """The README's promise: another program on the port (another PostgreSQL or Kafka of the same machine) is
    said in one line, before anything is fetched, initialised or written, not as the server's own log."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _script(script, {variable: str(port), "SKILLSTATS_STATE_DIR": str(tmp_path), **named})
    moved_by = named.get("PG_PORT_SETTING", variable)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and done.stdout == "", (done.returncode, done.stdout)
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "is taken" in lines[0] and f"{moved_by}=" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # said first: no jars fetched, no data directory made


def test_a_port_bound_without_a_listener_is_said_in_one_line_too() -> None:
    """A socket bound but not listening answers no connection: PostgreSQL's own bind fails, after initdb. The
    line is the same, not the server's log and "did not start"."""
    # The server runs as the `postgres` user when we are root: its data directory must be reachable by it.
    state = Path(tempfile.mkdtemp(prefix="skillstats-pg-port-"))
    state.chmod(0o755)
    try:
        with socket.socket() as bound:
            bound.bind(("127.0.0.1", 0))
            port = bound.getsockname()[1]
            env = {"PG_PORT": str(port), "SKILLSTATS_STATE_DIR": str(state)}
            done = _script("postgres.sh", env)
            if done.returncode == 0:  # started after all: stop it before failing
                subprocess.run([str(ROOT / "deploy/local/postgres.sh"), "stop"], env={**os.environ, **env}, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1, done.stderr
        assert f"127.0.0.1:{port}" in lines[0] and "is taken" in lines[0] and "PG_PORT=" in lines[0], lines[0]
        assert (state / f"pg-{port}" / "PG_VERSION").exists()  # initialised first: the bind failed after it
    finally:
        shutil.rmtree(state, ignore_errors=True)
