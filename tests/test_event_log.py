"""The written trail: what is kept (the events table and events.jsonl) and what only reaches the console log."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.events import EventLog, EventTail, Redactor
from providers.base import RetryPolicy, Throttled, call
from state.store import Store


@pytest.fixture
def log(tmp_path: Path) -> Iterator[tuple[EventLog, io.StringIO, Store]]:
    store = Store(f"sqlite:///{tmp_path / 'burstctl.db'}")
    console = io.StringIO()
    yield EventLog(store, tmp_path, Redactor([]), console=console), console, store
    store.close()


def kept(tmp_path: Path, store: Store) -> tuple[list[str], list[str]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e["type"] for e in store.events()], [json.loads(line)["event"] for line in lines]


def test_a_provider_call_that_succeeds_first_time_is_kept_nowhere_and_shown_only_when_asked(
        tmp_path: Path, log: tuple[EventLog, io.StringIO, Store]) -> None:
    events, console, store = log
    for verbose in (False, True):  # `daemon --verbose`
        events.routine_calls = verbose
        for _ in range(100):  # a day of ticks, in miniature
            call("ec2", "DescribeInstances", lambda: {}, sink=events.provider_sink)
    assert kept(tmp_path, store) == ([], [])
    assert console.getvalue().count("DescribeInstances") == 100  # the verbose hundred: they would bury the rest


def test_every_console_line_starts_with_the_local_time_to_the_second(
        log: tuple[EventLog, io.StringIO, Store]) -> None:
    events, console, _ = log
    before = time.time()
    events.emit("job.queued", job_id="j1")
    events.console("provider.call", provider="sim", call="offers")
    after = time.time()
    lines = console.getvalue().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line[19] == " ", line
        stamped = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))  # local time, to the second
        # A second either side: the shared CI machine's clock was once seen to step between the two readings.
        assert before - 1 <= stamped <= after + 1, (line, before, after)


def test_retries_and_failures_of_provider_calls_are_kept(tmp_path: Path,
                                                         log: tuple[EventLog, io.StringIO, Store]) -> None:
    events, _, store = log
    tries = iter([Throttled("slow down", code="Throttling"), None])

    def flaky() -> str:
        exc = next(tries)
        if exc:
            raise exc
        return "ok"

    call("ec2", "DescribeInstances", flaky, sink=events.provider_sink, retry=RetryPolicy(initial_s=0, max_wait_s=0),
         sleep=lambda _: None)
    with pytest.raises(Throttled):
        call("ec2", "RunInstances", lambda: (_ for _ in ()).throw(Throttled("no", code="Throttling")),
             sink=events.provider_sink, retry=RetryPolicy(attempts=1), sleep=lambda _: None)
    in_db, in_file = kept(tmp_path, store)
    assert in_db == in_file == ["provider.retry", "provider.call", "provider.call"]
    outcomes = [(e["data"]["call"], e["data"]["outcome"], e["data"]["tries"]) for e in store.events()
                if e["type"] == "provider.call"]
    assert outcomes == [("DescribeInstances", "ok", 2), ("RunInstances", "Throttled", 1)]


def test_other_provider_events_are_kept(tmp_path: Path, log: tuple[EventLog, io.StringIO, Store]) -> None:
    events, _, store = log
    events.provider_sink("provider.launched", provider="ec2", instance="i-1")
    assert kept(tmp_path, store) == (["provider.launched"], ["provider.launched"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_event_of_a_transaction_reaches_events_jsonl_and_the_console_once_it_commits_and_never_if_it_rolls_back(
        tmp_path: Path, log: tuple[EventLog, io.StringIO, Store]) -> None:
    # The events table holds only what committed; the file and the console said an event as it was emitted, so a
    # transaction that failed after it (or a daemon killed inside it, which says it again at its restart) left a
    # line there of what never happened.
    events, console, store = log
    with pytest.raises(RuntimeError), store.tx() as conn:
        events.emit("instance.interruption_notice", job_id="j1", conn=conn)
        raise RuntimeError("the write after it failed")
    assert kept(tmp_path, store) == ([], []) and console.getvalue() == ""
    with store.tx() as conn:
        events.emit("instance.interruption_notice", job_id="j1", conn=conn)
        events.emit("job.resuming", job_id="j1", conn=conn)
        assert kept(tmp_path, store)[1] == [] and console.getvalue() == ""  # not yet committed
    types = ["instance.interruption_notice", "job.resuming"]
    assert kept(tmp_path, store) == (types, types)  # in the order emitted
    assert [line.split()[2] for line in console.getvalue().splitlines()] == types
    events.emit("job.done", job_id="j1")  # outside a transaction: at once, as before
    assert kept(tmp_path, store)[1][-1] == "job.done"


def test_following_prints_each_event_once_and_forgets_what_is_settled(db_url: str) -> None:
    store, clock = Store(db_url), Clock()
    tail = EventTail(store, clock=clock, grace_s=10.0)
    ids = [store.append_event(f"job.e{i}", {}) for i in range(3)]
    assert [e["id"] for e in tail.poll()] == ids
    assert tail.poll() == []
    clock.now = 11.0
    assert tail.poll() == [] and tail.settled == ids[-1] and tail.recent == {}
    later = store.append_event("job.e3", {})
    assert [e["id"] for e in tail.poll()] == [later]
    store.close()


def test_following_prints_an_event_that_commits_after_a_later_one(postgres_server) -> None:
    # On PostgreSQL ids are handed out at insert and made visible at commit, in the writers' own order.
    store, clock = Store(postgres_server.new_database()), Clock()
    tail = EventTail(store, clock=clock, grace_s=10.0)
    with store.engine.begin() as slow:  # e.g. the daemon's tick, still writing
        first = store.append_event("job.slow", {}, conn=slow)
        second = store.append_event("job.fast", {})  # e.g. `burstctl cancel`, committed at once
        assert second > first
        assert [e["type"] for e in tail.poll()] == ["job.fast"]
    assert store.events(after_id=second) == []  # what reading past the last printed id would have seen
    assert [e["type"] for e in tail.poll()] == ["job.slow"]
    assert tail.poll() == []
    store.close()


def _lines(tmp_path: Path) -> dict[str, list[dict[str, object]]]:
    return {f.name: [json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted(tmp_path.glob("events.jsonl*")) if not f.name.endswith(".lock")}


def test_events_jsonl_is_rotated_past_its_size_and_only_the_newest_files_are_kept(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'burstctl.db'}")
    log = EventLog(store, tmp_path, Redactor([]), max_bytes=2000, kept=3)
    try:
        for i in range(200):
            log.emit("job.note", n=i, pad="x" * 80)
    finally:
        log.close()
    files = _lines(tmp_path)
    assert sorted(files) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"]
    assert all(2000 <= (tmp_path / name).stat().st_size < 2200 for name in files if name != "events.jsonl")
    # Newest last, in order, with no gap: what is kept is the tail of the trail, and the table keeps it all.
    kept_ns = [e["n"] for name in ("events.jsonl.3", "events.jsonl.2", "events.jsonl.1", "events.jsonl")
               for e in files[name]]
    assert kept_ns == list(range(200 - len(kept_ns), 200))
    assert len(store.events()) == 200
    store.close()


_WRITER = """
import sys
from pathlib import Path
from orchestrator.events import EventLog, Redactor
from state.store import Store
where, who = Path(sys.argv[1]), sys.argv[2]
store = Store(f"sqlite:///{where / 'burstctl.db'}")
log = EventLog(store, where, Redactor([]), max_bytes=3000, kept=1000)
for i in range(150):
    log.emit("job.note", who=who, n=i, pad="y" * 60)
log.close()
store.close()
"""


def test_processes_writing_at_once_rotate_it_without_losing_or_splitting_a_line(tmp_path: Path) -> None:
    Store(f"sqlite:///{tmp_path / 'burstctl.db'}").close()
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w)]) for w in range(4)]
    assert [p.wait(120) for p in writers] == [0, 0, 0, 0]
    files = _lines(tmp_path)  # every line parses: none was split
    assert len(files) > 10, "rotated many times while all four wrote"
    seen = sorted((e["who"], e["n"]) for lines in files.values() for e in lines)
    assert seen == sorted((str(w), i) for w in range(4) for i in range(150)), "each line once, none lost"


def test_a_full_disk_under_events_jsonl_drops_its_lines_with_one_warning_and_the_trail_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here to stand for a full disk")
    store = Store(f"sqlite:///{tmp_path / 'burstctl.db'}")
    (tmp_path / "events.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    log = EventLog(store, tmp_path, Redactor([]))
    try:
        with store.tx() as conn:  # inside a caller's transaction, as the reconciler emits
            ids = [log.emit("job.note", n=i, conn=conn) for i in range(3)]
    finally:
        log.close()
    assert [e["id"] for e in store.events()] == ids, "the events table has them all"
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and "events.jsonl: cannot write (No space left on device)" in warned[0], warned
    store.close()
