"""Schedules (rdq_core/engine/schedules.py, rdq_core/engine/cron.py): expressions, next fire times, time zones and daylight saving
time, the catch-up policy driven by a fake clock, and firing exactly once per period."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from rdq_core import Client
from rdq_core.errors import InvalidInput, StorageUnavailable, TaskNotFound
from rdq_core.engine.schedules import (
    LocalScheduleBook,
    Schedule,
    ScheduleClient,
    ScheduleFirer,
    ScheduleNotFound,
    due_instant,
    fire,
    parse_scheduled_time,
    schedule_body,
    task_id_for,
)
from rdq_core.aws.scheduler import target_input
from rdq_core.engine.cron import parse_expression
from rdq_core.validation import TASK_ID

UTC = timezone.utc
NEW_YORK = ZoneInfo("America/New_York")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def fires(expression: str, zone: str, start: datetime, count: int) -> list[datetime]:
    parsed = parse_expression(expression, zone)
    found: list[datetime] = []
    at = start
    for _ in range(count):
        nxt = parsed.next_after(at)
        assert nxt is not None
        found.append(nxt)
        at = nxt
    return found


class FakeClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@pytest.fixture
def client(tmp_path: Path) -> Client:
    with Client(f"sqlite:///{tmp_path}/rdq.db") as c:
        c.storage.migrate()
        yield c


# -- ids -----------------------------------------------------------------------------------------

def test_the_id_names_the_schedule_and_the_period_in_utc_and_is_a_valid_task_id():
    instant = datetime(2026, 12, 3, 18, 0, tzinfo=ZoneInfo("Europe/Paris"))
    assert task_id_for("nightly", instant) == "sched.nightly.20261203T170000Z"
    longest = task_id_for("n" * 64, instant)
    assert TASK_ID.fullmatch(longest), longest
    assert TASK_ID.fullmatch(task_id_for("a.b-c_d", instant))


def test_scheduled_time_as_scheduler_substitutes_it():
    assert parse_scheduled_time("2022-03-22T18:59:43Z") == utc(2022, 3, 22, 18, 59, 43)
    assert parse_scheduled_time("2022-03-22T19:59:43+01:00") == utc(2022, 3, 22, 18, 59, 43)
    for bad in ("<aws.scheduler.scheduled-time>", "2022-03-22T18:59:43", None, 5):
        with pytest.raises(InvalidInput):
            parse_scheduled_time(bad)


# -- expressions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", [
    "cron(0 3 * * * *)",          # neither day field is ?
    "cron(0 3 ? * ? *)",          # both are
    "cron(0 3 * *)",              # four fields
    "cron(60 3 * * ? *)",         # minute out of range
    "cron(0 24 * * ? *)",         # hour out of range
    "cron(0 3 ? * 8 *)",          # day of week out of range
    "cron(0 3 * 13 ? *)",         # month out of range
    "cron(0  3 * * ? *)",         # two spaces
    "cron(0 3 * * ? *) ",         # trailing space
    "cron(0 3 * * ? 1969)",       # year out of range
    "cron(0/0 3 * * ? *)",        # step 0
    "rate(01 minute)",            # leading zero
    "cron(? 3 * * ? *)",          # ? in minutes
    "rate(0 minutes)",
    "rate(1 minutes)",            # 1 takes the singular
    "rate(5 minute)",             # more than 1 takes the plural
    "rate(5 weeks)",
    "rate(5 seconds)",            # seconds: local hosts only
    "every 5 minutes",
    "",
])
def test_malformed_expressions_are_refused(expression):
    with pytest.raises(InvalidInput) as refused:
        parse_expression(expression, "UTC")
    assert refused.value.field == "expression"


def test_an_unknown_time_zone_is_refused():
    with pytest.raises(InvalidInput) as refused:
        parse_expression("cron(0 3 * * ? *)", "Mars/Olympus_Mons")
    assert refused.value.field == "timezone"


def test_seconds_are_accepted_only_when_asked_for():
    assert parse_expression("rate(5 seconds)", "UTC", allow_seconds=True).seconds == 5
    assert parse_expression("rate(1 second)", "UTC", allow_seconds=True).seconds == 1


def test_rates_count_from_the_epoch():
    rate = parse_expression("rate(15 minutes)", "Europe/Paris")  # a rate ignores the zone
    assert rate.next_after(utc(2026, 12, 3, 17, 7, 30)) == utc(2026, 12, 3, 17, 15)
    assert rate.next_after(utc(2026, 12, 3, 17, 15)) == utc(2026, 12, 3, 17, 30)  # strictly after
    assert rate.latest_at_or_before(utc(2026, 12, 3, 17, 29, 59)) == utc(2026, 12, 3, 17, 15)
    assert rate.latest_at_or_before(utc(2026, 12, 3, 17, 30)) == utc(2026, 12, 3, 17, 30)
    assert rate.latest_at_or_before(utc(2026, 12, 3, 17, 29), not_before=utc(2026, 12, 3, 17, 16)) is None


def test_cron_fields():
    weekdays_nine = fires("cron(0 9 ? * MON-FRI *)", "UTC", utc(2026, 12, 4, 10), 3)  # from Friday 10:00
    assert weekdays_nine == [utc(2026, 12, 7, 9), utc(2026, 12, 8, 9), utc(2026, 12, 9, 9)]
    assert fires("cron(0/20 8-9 * * ? *)", "UTC", utc(2026, 1, 1), 7) == [
        utc(2026, 1, 1, 8, 0), utc(2026, 1, 1, 8, 20), utc(2026, 1, 1, 8, 40),
        utc(2026, 1, 1, 9, 0), utc(2026, 1, 1, 9, 20), utc(2026, 1, 1, 9, 40), utc(2026, 1, 2, 8, 0)]
    assert fires("cron(30 12 L FEB,MAR ? 2028)", "UTC", utc(2026, 1, 1), 2) == [utc(2028, 2, 29, 12, 30),
                                                                                 utc(2028, 3, 31, 12, 30)]
    assert fires("cron(0 9 ? * 2#1 *)", "UTC", utc(2026, 12, 1), 2) == [utc(2026, 12, 7, 9), utc(2027, 1, 4, 9)]
    assert fires("cron(0 9 ? * 6L *)", "UTC", utc(2026, 2, 1), 2) == [utc(2026, 2, 27, 9), utc(2026, 3, 27, 9)]
    # 15W: the weekday nearest the 15th (2026-08-15 is a Saturday: Friday the 14th)
    assert fires("cron(0 9 15W * ? *)", "UTC", utc(2026, 8, 1), 1) == [utc(2026, 8, 14, 9)]
    # a year that has passed never fires again
    assert parse_expression("cron(0 9 * * ? 2020)", "UTC").next_after(utc(2026, 1, 1)) is None


def test_a_backwards_range_wraps_around():
    assert fires("cron(0 22-1 * * ? *)", "UTC", utc(2026, 1, 1, 12), 4) == [
        utc(2026, 1, 1, 22), utc(2026, 1, 1, 23), utc(2026, 1, 2, 0), utc(2026, 1, 2, 1)]
    assert [d.weekday() for d in fires("cron(0 9 ? * FRI-MON *)", "UTC", utc(2026, 12, 3), 4)] == [4, 5, 6, 0]


def test_a_date_that_never_exists_ends_the_search():
    parsed = parse_expression("cron(0 0 30 FEB ? *)", "UTC")
    assert parsed.next_after(utc(2026, 1, 1)) is None
    assert parsed.latest_at_or_before(utc(2026, 1, 1)) is None


def test_the_grammar_and_the_parser_agree():
    """EXPRESSION_PATTERN (with the 256-character limit) is what the OpenAPI document states:
    every expression it matches parses and has a next fire time computed without error."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from rdq_core.engine.cron import EXPRESSION_PATTERN

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, phases=[Phase.generate])
    @given(st.from_regex(f"^{EXPRESSION_PATTERN}$", fullmatch=True).filter(lambda text: len(text) <= 256))
    def parses(text: str) -> None:
        parse_expression(text, "Europe/Paris").next_after(utc(2026, 12, 3))

    parses()


def test_a_cron_is_evaluated_in_its_time_zone():
    # 09:00 in Paris is 08:00 UTC in winter, 07:00 UTC in summer
    assert fires("cron(0 9 * * ? *)", "Europe/Paris", utc(2026, 1, 10), 1) == [utc(2026, 1, 10, 8)]
    assert fires("cron(0 9 * * ? *)", "Europe/Paris", utc(2026, 7, 10), 1) == [utc(2026, 7, 10, 7)]


# -- daylight saving time ------------------------------------------------------------------------

def test_spring_forward_skips_a_time_that_does_not_exist():
    # America/New_York, 2026-03-08: 02:00 EST jumps to 03:00 EDT, so 02:30 does not exist that day
    runs = fires("cron(30 2 * * ? *)", "America/New_York", utc(2026, 3, 7, 12), 2)
    assert [r.astimezone(NEW_YORK).date().isoformat() for r in runs] == ["2026-03-09", "2026-03-10"]
    assert runs[0] == utc(2026, 3, 9, 6, 30)  # 02:30 EDT
    # the hourly schedule has 23 runs that day, never two in one UTC hour
    hourly = fires("cron(0 * * * ? *)", "America/New_York", utc(2026, 3, 8, 5), 23)
    assert len(set(hourly)) == 23 and hourly == sorted(hourly)
    assert all(b - a == timedelta(hours=1) for a, b in zip(hourly, hourly[1:], strict=False))


def test_fall_back_fires_a_repeated_time_once():
    # America/New_York, 2026-11-01: 02:00 EDT goes back to 01:00 EST, so 01:30 happens twice
    runs = fires("cron(30 1 * * ? *)", "America/New_York", utc(2026, 10, 31, 12), 3)
    assert runs == [utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30), utc(2026, 11, 3, 6, 30)]
    # and the hour that repeats is one period, so one task id
    hourly = fires("cron(0 * * * ? *)", "America/New_York", utc(2026, 11, 1, 4, 30), 4)
    assert [h.astimezone(NEW_YORK).strftime("%H %Z") for h in hourly] == ["01 EDT", "02 EST", "03 EST", "04 EST"]


def test_the_latest_period_across_a_transition_looks_back_correctly():
    parsed = parse_expression("cron(30 2 * * ? *)", "America/New_York")
    # on the morning of the skipped day, the latest 02:30 is the previous day's
    assert parsed.latest_at_or_before(utc(2026, 3, 8, 12)) == utc(2026, 3, 7, 7, 30)


# -- catch-up policy (fake clock) ----------------------------------------------------------------

def test_after_downtime_only_the_most_recent_missed_period_fires_once(client):
    clock = FakeClock(utc(2026, 12, 3, 8, 0, 30))
    schedule = Schedule("hourly", "cron(0 * * * ? *)", "reports", "build", created_at=utc(2026, 12, 3, 7, 30))
    book = _book_with(client, schedule)
    firer = ScheduleFirer(client, book, clock=clock)

    assert [f.task_id for f in firer.tick()] == ["sched.hourly.20261203T080000Z"]
    assert firer.tick() == []  # the same period: nothing more
    clock.advance(minutes=59)
    assert firer.tick() == []  # 08:59:30, still the 08:00 period

    clock.advance(hours=5)  # down from 08:59 to 13:59: 09:00 .. 13:00 were missed
    fired = firer.tick()
    assert [f.task_id for f in fired] == ["sched.hourly.20261203T130000Z"]  # the latest, once; no backlog
    ids = [t.id for t in client.list_tasks("reports", limit=100).tasks]
    assert sorted(ids) == ["sched.hourly.20261203T080000Z", "sched.hourly.20261203T130000Z"]


def test_a_restarted_host_fires_the_current_period_again_and_the_store_keeps_one_task(client):
    clock = FakeClock(utc(2026, 12, 3, 8, 10))
    schedule = Schedule("hourly", "cron(0 * * * ? *)", "reports", "build", created_at=utc(2026, 12, 3, 7))
    book = _book_with(client, schedule)
    first = ScheduleFirer(client, book, clock=clock).tick()
    again = ScheduleFirer(client, book, clock=clock).tick()  # a second host, or a restart
    assert [f.created for f in first] == [True]
    assert [(f.task_id, f.created) for f in again] == [("sched.hourly.20261203T080000Z", False)]
    assert len(client.list_tasks("reports", limit=100).tasks) == 1


def test_no_period_before_the_schedule_was_created_fires(client):
    clock = FakeClock(utc(2026, 12, 3, 8, 10))
    schedule = Schedule("hourly", "cron(0 * * * ? *)", "reports", "build", created_at=utc(2026, 12, 3, 8, 5))
    firer = ScheduleFirer(client, _book_with(client, schedule), clock=clock)
    assert firer.tick() == []
    clock.advance(minutes=50)  # 09:00
    assert [f.task_id for f in firer.tick()] == ["sched.hourly.20261203T090000Z"]
    assert due_instant(schedule, utc(2026, 12, 3, 8, 59)) is None


def test_a_replaced_schedule_starts_over_from_its_replacement(client, tmp_path):
    clock = FakeClock(utc(2026, 12, 3, 8, 10))
    book = LocalScheduleBook(tmp_path / "s.json", clock=clock)
    book.put(Schedule("job", "rate(5 minutes)", "q", "h"))
    firer = ScheduleFirer(client, book, clock=clock)
    clock.advance(minutes=1)  # 08:11: the 08:10 period is not before the creation (08:10:00)
    assert [f.task_id for f in firer.tick()] == ["sched.job.20261203T081000Z"]
    clock.advance(minutes=1)
    book.put(Schedule("job", "rate(1 hour)", "q", "h"))  # replaced at 08:12
    assert firer.tick() == []  # the hourly 08:00 period precedes the replacement
    clock.advance(minutes=48)
    assert [f.task_id for f in firer.tick()] == ["sched.job.20261203T090000Z"]


def test_a_firing_that_fails_is_retried_on_the_next_tick(client):
    clock = FakeClock(utc(2026, 12, 3, 8, 10))
    schedule = Schedule("hourly", "cron(0 * * * ? *)", "reports", "build", created_at=utc(2026, 12, 3, 7))

    class Flaky:
        calls = 0

        def enqueue_new(self, new_task):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise StorageUnavailable("down")
            return client.enqueue_new(new_task)

    firer = ScheduleFirer(Flaky(), _book_with(client, schedule), clock=clock)
    with pytest.raises(StorageUnavailable):
        firer.tick()
    assert [f.task_id for f in firer.tick()] == ["sched.hourly.20261203T080000Z"]


# -- firing ---------------------------------------------------------------------------------------

def test_duplicate_and_retried_triggers_make_one_task(client):
    schedule = Schedule("nightly", "cron(0 3 * * ? *)", "reports", "build", payload={"kind": "daily"}, max_attempts=3)
    instant = utc(2026, 12, 3, 3)
    results = [fire(client, schedule, instant) for _ in range(5)]
    assert [r.created for r in results] == [True, False, False, False, False]
    task = client.get("sched.nightly.20261203T030000Z")
    assert (task.queue, task.handler, task.payload, task.max_attempts) == ("reports", "build", {"kind": "daily"}, 3)


def test_a_period_already_fired_on_another_queue_counts_as_fired(client):
    instant = utc(2026, 12, 3, 3)
    fire(client, Schedule("nightly", "cron(0 3 * * ? *)", "reports", "build"), instant)
    moved = fire(client, Schedule("nightly", "cron(0 3 * * ? *)", "other", "build"), instant)
    assert moved.created is False
    assert client.get(moved.task_id).queue == "reports"


# -- the local book --------------------------------------------------------------------------------

def test_the_local_book_creates_replaces_lists_and_deletes(tmp_path):
    clock = FakeClock(utc(2026, 12, 3, 8, 10, 5, 123))
    book = LocalScheduleBook(tmp_path / "schedules.json", clock=clock)
    assert book.list() == []
    stored = book.put(Schedule("b", "rate(5 minutes)", "q", "h"))
    assert stored.created_at == utc(2026, 12, 3, 8, 10, 5)
    book.put(Schedule("a", "cron(0 3 * * ? *)", "q", "h", timezone="Europe/Paris", payload=[1, 2]))
    book.put(Schedule("b", "rate(10 minutes)", "q", "h"))
    assert [(s.name, s.expression) for s in book.list()] == [("a", "cron(0 3 * * ? *)"), ("b", "rate(10 minutes)")]
    on_disk = json.loads((tmp_path / "schedules.json").read_text())
    assert [s["name"] for s in on_disk["schedules"]] == ["a", "b"]
    # another process (a second book on the same file) sees the same definitions
    assert LocalScheduleBook(tmp_path / "schedules.json").get("a").payload == [1, 2]
    book.delete("a")
    with pytest.raises(ScheduleNotFound):
        book.delete("a")
    assert isinstance(ScheduleNotFound("x"), TaskNotFound)  # 404 and exit code 3 wherever it surfaces
    assert [s.name for s in book.list()] == ["b"]


def test_the_schedule_client_validates_definitions(tmp_path):
    schedules = ScheduleClient(LocalScheduleBook(tmp_path / "s.json"))
    for bad, field in (({"name": ".x", "expression": "rate(1 minute)", "queue": "q", "handler": "h"}, "name"),
                       ({"name": "x", "expression": "rate(1 minute)", "queue": "Q!", "handler": "h"}, "queue"),
                       ({"name": "x", "expression": "rate(1 minute)", "queue": "q", "handler": "h", "extra": 1}, "extra"),
                       ({"name": "x", "expression": "rate(1 minute)", "queue": "q", "handler": "h",
                         "max_attempts": 0}, "max_attempts")):
        with pytest.raises(InvalidInput) as refused:
            schedules.put_schedule(bad)
        assert refused.value.field == field
    stored = schedules.put_schedule({"name": "x", "expression": "rate(2 seconds)", "queue": "q", "handler": "h"})
    body = schedule_body(stored, now=utc(2026, 12, 3, 8, 0, 1))
    assert (body["next_fire_at"], body["next_task_id"]) == ("2026-12-03T08:00:02Z", "sched.x.20261203T080002Z")


def test_the_scheduler_target_input_carries_the_definition_and_the_scheduled_time_attribute():
    schedule = Schedule("nightly", "cron(0 3 * * ? *)", "reports", "build", payload={"a": 1}, timezone="Europe/Paris")
    body = json.loads(target_input(schedule.to_dict()))
    assert body["scheduled_time"] == "<aws.scheduler.scheduled-time>"
    assert Schedule.from_dict(body["rdq_schedule"]) == schedule


def _book_with(client: Client, schedule: Schedule) -> LocalScheduleBook:
    class Fixed(LocalScheduleBook):
        def list(self) -> list[Schedule]:
            return [schedule]

    return Fixed(Path("/nonexistent/never-read.json"))


def test_writers_on_one_file_never_lose_each_others_changes(tmp_path):
    import threading

    def writer(n: int) -> None:
        book = LocalScheduleBook(tmp_path / "s.json")  # its own book: only the file lock is shared
        for i in range(15):
            book.put(Schedule(f"w{n}-{i}", "rate(1 minute)", "q", "h"))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(LocalScheduleBook(tmp_path / "s.json").list()) == 60
