"""How a consumer is measured: timed from process start to caught up (or to its exit), CPU time and peak RSS.

Each consumer runs in a process of its own (bench/roles.py, or a `skillstats` command), on a fresh
consumer group, from a cold start until it has caught up with the preloaded records; `wait4` gives
its CPU seconds (user + system, process start to exit), /proc its peak RSS (`Watched`). The steady
rate is counted from its first record (or first SQL fence) to caught up, and so is the steady CPU
(/proc/PID/stat read at both moments, or the role's own clock): start-up (the imports alone are about
a CPU second for a windows worker, 0.1 for the bare loop) and shutdown are in the first figure and not
in the second, which is what a long-running worker spends per event. Also here: the docsync drain (one run, as
a CronJob runs it), Kafka's own kafka-consumer-perf-test, and the probes the cases poll.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import DOCSYNC, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink


@dataclass
class Result:
    name: str
    events: int
    wall_seconds: float  # process start -> caught up
    steady_seconds: float  # first record -> caught up
    peak_rss_mb: float
    note: str = ""
    cpu_seconds: float = 0.0  # user + system, process start to exit
    rows_upserted: int | None = None  # None: the consumer writes no SQL
    steady_cpu_seconds: float | None = None  # first record (or first SQL fence) -> caught up; None: not measured

    @property
    def rate(self) -> float:
        return self.events / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def cpu_per_million(self) -> float:
        return self.cpu_seconds * 1_000_000 / self.events if self.events else 0.0

    @property
    def steady_cpu_per_million(self) -> float | None:
        if self.steady_cpu_seconds is None or not self.events:
            return None
        return self.steady_cpu_seconds * 1_000_000 / self.events

    @property
    def rows_rate(self) -> float | None:
        if self.rows_upserted is None or self.steady_seconds <= 0:
            return None
        return self.rows_upserted / self.steady_seconds


class Watched:
    """A started process, measured to its exit: CPU seconds (user + system, from `wait4`) and peak RSS.

    The peak RSS is the process's VmHWM (/proc/PID/status), read every 20 ms until it exits, not `wait4`'s
    ru_maxrss: the kernel keeps, across exec, the high-water mark of the memory the child was forked from (the
    bench process's own; with vfork, the bench's peak itself), so ru_maxrss said the bench's peak for any child
    smaller than it. VmHWM starts again at exec. A process gone before a first read falls back to ru_maxrss."""

    def __init__(self, process: subprocess.Popen[Any]) -> None:
        self.process = process
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            peak = vm_hwm_mb(self.process.pid)
            if peak is None:  # exited: a zombie has no memory left to read
                return
            self.peak_mb = max(self.peak_mb, peak)
            self._stop.wait(0.02)

    def wait(self) -> tuple[int, float, float]:
        """Wait for the exit: (exit status, as Popen.returncode says it; CPU seconds; peak RSS MiB)."""
        # Exited, not yet reaped: the watcher stops before the pid can name another process.
        os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        self._stop.set()
        self._watcher.join()
        _pid, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        peak = self.peak_mb or usage.ru_maxrss / 1024
        return self.process.returncode, usage.ru_utime + usage.ru_stime, peak


def vm_hwm_mb(pid: int) -> float | None:
    """The peak resident set of a running process since its exec (VmHWM), MiB; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def cpu_seconds_so_far(pid: int) -> float:
    """User + system CPU seconds a running process (all its threads) has spent since its exec (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The fields after the command name, which is in parentheses and may hold spaces: utime and stime are
        # the 14th and 15th of the whole line.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(
    name: str,
    argv: list[str] | list[list[str]],
    env: dict[str, str],
    events: int,
    done: Callable[[], bool] | None,
    first_progress: Callable[[], bool] | None = None,
    note: str = "",
    rows: Callable[[], int] | None = None,
) -> Result:
    """Run `argv` until it exits (done=None) or `done()` holds; time it, read its CPU time and peak RSS.

    `argv` may be several command lines (with `done`): processes started together
    and measured as one consumer, their CPU times summed, the largest peak RSS.
    `rows`, asked once `done()` holds and before the processes are stopped, says
    how many SQL rows they wrote.
    """
    log(f"{name}: starting")
    started = time.monotonic()
    argvs: list[list[str]] = argv if isinstance(argv[0], list) else [argv]  # type: ignore[assignment,list-item]
    processes = [
        subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for line in argvs
    ]
    watched = [Watched(running) for running in processes]
    process = processes[0]
    first_at = 0.0
    # Until the first progress is seen, the steady window starts at process start (as `steady` does with
    # first_at unset): the processes' CPU from their start.
    cpu_at_first = 0.0
    steady_cpu: float | None = None
    rows_upserted = None
    if done is not None:
        while not done():
            if first_progress is not None and not first_at and first_progress():
                first_at = time.monotonic()
                cpu_at_first = sum(cpu_seconds_so_far(running.pid) for running in processes)
            for running in processes:
                if running.poll() is not None:
                    raise RuntimeError(f"{name} exited early with status {running.returncode}")
            time.sleep(0.05)
        finished = time.monotonic()
        steady_cpu = sum(cpu_seconds_so_far(running.pid) for running in processes) - cpu_at_first
        rows_upserted = rows() if rows is not None else None
        for running in processes:
            running.terminate()
    cpu_seconds, peak_rss_mb = 0.0, 0.0
    for one in watched:
        _status, cpu, peak = one.wait()
        cpu_seconds += cpu
        peak_rss_mb = max(peak_rss_mb, peak)
    output = process.stdout.read() if process.stdout else ""
    if done is None:
        finished = time.monotonic()
        if process.returncode != 0:
            raise RuntimeError(f"{name} failed with status {process.returncode}: {output[-500:]}")
        fields = dict(part.split("=") for part in output.split() if "=" in part)
        steady = float(fields["last"]) - float(fields["first"])
        if "cpu_last" in fields:
            steady_cpu = float(fields["cpu_last"]) - float(fields["cpu_first"])
    else:
        steady = finished - (first_at or started)
    result = Result(name, events, finished - started, steady, peak_rss_mb, note, cpu_seconds, rows_upserted, steady_cpu)
    steady_part = f" ({result.steady_cpu_per_million:.1f} steady)" if result.steady_cpu_per_million is not None else ""
    log(
        f"{name}: {result.rate:,.0f} events/s steady, {result.cpu_per_million:.1f} CPU s per million{steady_part}, "
        f"{result.wall_seconds:.1f}s wall, {result.peak_rss_mb:.0f} MiB"
    )
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rss_mb(pid: int) -> float:
    """The resident set of a running process now (/proc), MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def scraped_rows(ports: list[int], events: int) -> Callable[[], int]:
    """Rows the workers serving metrics on `ports` say their upserts wrote (skillstats_rows_upserted_total).

    Read once their batches account for all `events` (skillstats_batch_records_sum): the
    fences move in the transaction, the metrics just after it.
    """

    def scrape() -> dict[str, float]:
        totals: dict[str, float] = {}
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                body = response.read().decode()
            for line in body.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in ("skillstats_rows_upserted_total", "skillstats_batch_records_sum"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def rows() -> int:
        deadline = time.monotonic() + 30
        totals = scrape()
        while totals.get("skillstats_batch_records_sum", 0) < events and time.monotonic() < deadline:
            time.sleep(0.05)
            totals = scrape()
        return int(totals.get("skillstats_rows_upserted_total", 0))

    return rows


def caught_up_sql(sink: WindowsSink, ends: dict[int, int]) -> Callable[[], bool]:
    wanted = {p: n for p, n in ends.items() if n}
    return lambda: sink.fences() == wanted


def any_sql_progress(sink: WindowsSink) -> Callable[[], bool]:
    return lambda: bool(sink.fences())


def prefix_offsets(settings: Settings, topic: str, count: int) -> dict[int, int]:
    """Per-partition end offsets covering about the first `count` records of the topic."""
    ends = {p: n for p, n in end_offsets(settings, topic).items() if n}
    total = sum(ends.values())
    return {p: max(1, n * count // total) for p, n in ends.items()} if count < total else ends


def measure_docsync(name: str, settings: Settings, database_url: str, group: str, events: int) -> Result:
    """One drain as a CronJob runs it: process start to exit; steady = the drain's own duration."""
    engine = open_engine(database_url)
    upgrade(engine)
    release(engine, DOCSYNC)  # every case is a new group and topic in the scratch database
    _ensure_registry_rows(engine, events)
    drained = settings.override(docsync_group=group, database_url=database_url)
    log(f"{name}: starting")
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "docsync", "--json"],
        env=drained.child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    status, cpu, peak = Watched(process).wait()
    wall = time.monotonic() - started
    output = process.stdout.read() if process.stdout else ""
    if status != 0:
        raise RuntimeError(f"{name} failed: {output[-500:]}")
    summary = json.loads(output.strip().splitlines()[-1])
    if summary["events_read"] != events:
        raise RuntimeError(f"{name} read {summary['events_read']} of {events} events")
    result = Result(
        name,
        events,
        wall,
        summary["duration_seconds"],
        peak,
        f"{summary['skills_updated']:,} skills rows and {summary['owners_updated']:,} owners rows, once each",
        cpu,
        summary["skills_updated"] + summary["owners_updated"],
    )
    log(f"{name}: {result.rate:,.0f} events/s steady, {result.cpu_per_million:.1f} CPU s per million")
    return result


def _ensure_registry_rows(engine: Any, events: int) -> None:
    """`skills` rows for the benchmark's skill ids, 300 owners; rows already there are kept."""
    from sqlalchemy.dialects import postgresql, sqlite

    from skillstats.sinks.schema import skills
    from skillstats.workload import skill_ids

    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    rows = [{"id": s, "owner_id": f"user_{i % 300:03d}"} for i, s in enumerate(skill_ids(20_000))]
    with engine.begin() as connection:
        connection.execute(dialect.insert(skills).on_conflict_do_nothing(), rows)


def kafka_libs() -> Path:
    """Where deploy/local/kafka.sh keeps the Kafka jars: `SKILLSTATS_STATE_DIR`, else the `.local` of the checkout
    this bench runs from, whatever the working directory (a bench started elsewhere once skipped case f for want of
    them); installed from a wheel, with no checkout around it, the working directory's `.local`."""
    state = os.environ.get("SKILLSTATS_STATE_DIR")
    if state:
        return Path(state) / "kafka-libs"
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "deploy" / "local" / "kafka.sh").is_file():
        return checkout / ".local" / "kafka-libs"
    return Path(".local", "kafka-libs").absolute()


def kafka_perf_test(settings: Settings, topic: str, events: int) -> Result | None:
    """Kafka's own kafka-consumer-perf-test (the JVM client) on the same topic, when the Kafka jars are here."""
    libs = kafka_libs()
    if not libs.is_dir():
        log(
            f"kafka-consumer-perf-test: skipped, no Kafka jars at {libs} "
            "(deploy/local/kafka.sh fetch; SKILLSTATS_STATE_DIR names where they are)"
        )
        return None
    argv = [
        "java",
        "-Xmx1g",
        "-cp",
        f"{libs}/*",
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        settings.kafka_bootstrap,
        "--topic",
        topic,
        "--messages",
        str(events),
        "--group",
        f"bench-perftest-{uuid.uuid4().hex[:6]}",
        "--timeout",
        "120000",
    ]
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _status, _cpu, peak = Watched(process).wait()
    wall = time.monotonic() - started
    lines = [line for line in (process.stdout.read() if process.stdout else "").splitlines() if line.strip()]
    header, values = [h.strip() for h in lines[-2].split(",")], [v.strip() for v in lines[-1].split(",")]
    row = dict(zip(header, values, strict=False))
    fetch_rate = float(row.get("fetch.nMsg.sec", row.get("nMsg.sec", "0")))
    consumed = int(float(row.get("data.consumed.in.nMsg", events)))
    result = Result(
        "f. kafka-consumer-perf-test (JVM)",
        consumed,
        wall,
        consumed / fetch_rate if fetch_rate else wall,
        peak,
        "the tool's own fetch.nMsg.sec",
    )
    log(f"{result.name}: {result.rate:,.0f} events/s")
    return result
