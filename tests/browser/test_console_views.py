"""Every view of the console, in one scene with data in every state: the charts, a task page that
tells the truth in each status, tables that fit, axe-core at 0 serious or critical violations,
keyboard reach, and the screenshots in docs/images/ (regenerated here, at 1280×800 and 375×740).

The scene: ``rdq dev`` on SQLite with the console handlers; a day of per-minute metrics on the
``orders`` queue, loaded the way the maintenance pass writes them (``bench.console_queue``), and
real tasks made through the API: one that succeeded after a failed attempt, one dead with a long
id and message, one redriven after dying, one running (its handler waits for a file), one pending.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from bench.console_queue import seed_day
from rdq_core.compliance.support import wait_until
from rdq_core.storage import open_storage
from tests.browser.conftest import DESKTOP, HANDLERS, PHONE, WAIT_MS, Page, call, wait_status
from tests.rdq_servers import REPO, DevServer, dev_server

AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
IMAGES = REPO / "docs" / "images"
QUEUE = "orders"
LONG_ID = "order-2026-12-05-customer-4711-invoice-88213-shipment-eu-west-warehouse-7-retry-after-card-declined"
LONG_MESSAGE = ("the payment provider declined card ending 4242 for invoice 88213 after three authorisation attempts "
                "(issuer response 05: do not honour); the customer was notified and the order is on hold")


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("console-views")
    release = workdir / "release-the-running-task"
    with dev_server(workdir, handlers=HANDLERS) as dev:
        storage = open_storage(dev.storage_url)
        try:
            seed_day(storage, QUEUE)
        finally:
            storage.close()
        ids = {
            "flaky": _enqueue(dev, {"handler": "console.flaky", "payload": {"order": 1}, "max_attempts": 3}),
            "dead": _enqueue(dev, {"id": LONG_ID, "handler": "console.fail", "payload": {"order": 2}, "max_attempts": 1}),
            "redriven": _enqueue(dev, {"handler": "console.fail", "payload": {"order": 3}, "max_attempts": 1}),
            "pending": _enqueue(dev, {"handler": "console.ok", "payload": {"order": 5}, "delay_seconds": 3600}),
        }
        wait_status(dev.url, ids["flaky"], "SUCCEEDED", timeout=30)
        wait_status(dev.url, ids["redriven"], "DEAD")
        status, answer = call(dev.url, "POST", f"/v1/queues/{QUEUE}/dlq:redrive", {"ids": [ids["redriven"]]})
        assert status == 200 and answer["redriven"] == 1, answer
        wait_until(lambda: len(call(dev.url, "GET", f"/v1/tasks/{ids['redriven']}")[1]["attempts"]) == 2, 30,
                   what="the redriven task's second attempt")
        wait_status(dev.url, ids["dead"], "DEAD")
        # Last: while it runs, it holds the dev worker.
        ids["running"] = _enqueue(dev, {"handler": "console.wait", "payload": {"release": str(release), "seconds": 300}})
        wait_status(dev.url, ids["running"], "IN_FLIGHT")
        try:
            yield {"dev": dev, "ids": ids}
        finally:
            release.touch()


def _enqueue(dev: DevServer, body: dict[str, Any]) -> str:
    status, task = call(dev.url, "POST", f"/v1/queues/{QUEUE}/tasks", body)
    assert status in (200, 201), task
    return str(task["id"])


@pytest.fixture
def view(browser: Any, scene: dict[str, Any]) -> Iterator[Page]:
    opened = Page(browser, scene["dev"].url)
    try:
        yield opened
        assert opened.script_errors == [], f"script errors in the page: {opened.script_errors}"
    finally:
        opened.close()


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is (evaluated through the
    browser's debugging protocol, which the page's Content-Security-Policy does not govern)."""
    if not page.evaluate("() => typeof window.axe !== 'undefined'"):
        page.evaluate(AXE.read_text(encoding="utf-8") + "\n;true")
    found = page.evaluate("""async () => {
      const result = await window.axe.run(document, { resultTypes: ['violations'] });
      return result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical')
        .map((v) => ({ id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.slice(0, 3).map((n) => n.target.join(' ')) }));
    }""")
    return list(found)


#: Tables wider than their box at this viewport (their wrapper scrolls, so a column is hidden).
OVERFLOWING_TABLES = """() => [...document.querySelectorAll('.table-wrap')]
  .filter((wrap) => wrap.getClientRects().length && wrap.scrollWidth > wrap.clientWidth + 1)
  .map((wrap) => `${wrap.getAttribute('aria-label')}: ${wrap.scrollWidth} > ${wrap.clientWidth}`)"""


def check_and_shoot(view: Page, name: str) -> None:
    """At both sizes: axe at 0 serious/critical, no table cut off, the page not scrolling sideways;
    then the screenshot into docs/images/."""
    page = view.page
    IMAGES.mkdir(parents=True, exist_ok=True)
    for size in (DESKTOP, PHONE):
        page.set_viewport_size(size)
        page.evaluate("() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)))")
        label = f"{name} at {size['width']}x{size['height']}"
        assert axe_violations(page) == [], f"{label}: axe-core found serious or critical violations"
        assert page.evaluate(OVERFLOWING_TABLES) == [], f"{label}: a table is wider than the page"
        widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"{label}: the page scrolls sideways ({widths[0]} px wide)"
        page.screenshot(path=str(IMAGES / f"console-{name}-{size['width']}x{size['height']}.png"), full_page=True)
    page.set_viewport_size(DESKTOP)


def wait_charts(page: Any) -> None:
    page.wait_for_function("() => document.querySelector('section.charts[data-loaded]')"
                           " && document.querySelectorAll('section.charts figure.chart canvas').length >= 1",
                           timeout=WAIT_MS)


def test_views_queues_with_the_overview_chart(view: Page) -> None:
    p = view.open("/queues")
    expect(p.locator(f"tr[data-queue='{QUEUE}']")).to_be_visible()
    wait_charts(p)
    expect(p.locator("section.overview figcaption")).to_contain_text("succeeded")
    check_and_shoot(view, "queues")


def test_views_queue_page_charts_throughput_depth_age_and_handlers(view: Page) -> None:
    p = view.open(f"/queues/{QUEUE}/tasks")
    wait_charts(p)
    expect(p.locator("section.charts figure.chart canvas")).to_have_count(5)
    expect(p.locator("section.charts figure").first).to_contain_text("succeeded")
    handlers = p.locator("table.handlers tbody tr")
    expect(handlers.filter(has_text="orders.charge")).to_have_count(1)
    expect(p.locator("table.data tbody tr[data-task]").first).to_be_visible()
    # The README's first screen: the queue page as it opens at 1280×800.
    IMAGES.mkdir(parents=True, exist_ok=True)
    p.screenshot(path=str(IMAGES / "console-queue-first-screen.png"))
    check_and_shoot(view, "queue")
    # A legend entry hides its line by keyboard too.
    retried = p.locator("section.charts figure").first.get_by_role("button", name="Show Retried")
    expect(retried).to_have_attribute("aria-pressed", "true")
    retried.focus()
    p.keyboard.press("Enter")
    expect(retried).to_have_attribute("aria-pressed", "false")
    p.keyboard.press(" ")
    expect(retried).to_have_attribute("aria-pressed", "true")
    # The window switch redraws from the day's data, by keyboard.
    day = p.get_by_role("button", name="Last day")
    day.focus()
    p.keyboard.press("Enter")
    expect(p.locator("section.charts")).to_have_attribute("data-loaded", "day")
    expect(day).to_have_attribute("aria-pressed", "true")
    summary = p.locator("section.charts figure").first.locator(".chart-summary")
    expect(summary).to_contain_text("In the last day")
    check_and_shoot(view, "queue-day")


def test_views_dead_letter_queue_fits_with_long_ids_and_messages(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/queues/{QUEUE}/dlq")
    row = p.locator(f"tr[data-task='{LONG_ID}']")
    expect(row).to_be_visible()
    # Cut to fit, the whole id on hover; the last column stays in view.
    expect(row.locator("th .clip")).to_have_attribute("title", LONG_ID)
    dead_at = p.locator("table.data thead th", has_text="Dead at")
    box, page_width = dead_at.bounding_box(), p.evaluate("window.innerWidth")
    assert box is not None and box["x"] + box["width"] <= page_width, (box, page_width)
    check_and_shoot(view, "dlq")


def test_views_a_running_task_shows_its_running_attempt(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/tasks/{scene['ids']['running']}")
    running = p.locator("section.running")
    expect(running).to_contain_text("Running now: attempt 1")
    expect(running.locator("time")).to_have_count(2)  # started, lease expiry
    # The worker holding it, as the store has it: rdq dev's worker function and its request id.
    claimed_by = call(scene["dev"].url, "GET", f"/v1/tasks/{scene['ids']['running']}")[1]["claimed_by"]
    assert claimed_by.startswith("rdq-dev-worker request "), claimed_by
    expect(running.locator("dt:text-is('Worker') + dd")).to_have_text(claimed_by)
    expect(p.locator("dl.summary dt:text-is('Budget') + dd")).to_have_text("attempt 1 running")
    expect(p.locator("ol.timeline > li.outcome-running")).to_contain_text("RUNNING")
    expect(p.get_by_text("Not run yet")).to_have_count(0)
    check_and_shoot(view, "task-running")


def test_views_a_succeeded_task_shows_its_earlier_error_as_history(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/tasks/{scene['ids']['flaky']}")
    expect(p.locator("dl.summary")).to_contain_text("SUCCEEDED")
    expect(p.get_by_role("heading", name="Last error")).to_have_count(0)
    expect(p.get_by_role("heading", name="Why it is dead")).to_have_count(0)
    expect(p.locator(".earlier-errors")).to_contain_text("1 earlier attempt(s) failed before it succeeded")
    expect(p.locator("ol.timeline > li")).to_have_count(2)
    expect(p.locator("ol.timeline > li").first).to_contain_text("the upstream timed out")
    check_and_shoot(view, "task-succeeded")


def test_views_a_redriven_task_tells_one_story(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/tasks/{scene['ids']['redriven']}")
    expect(p.locator("dl.summary dt:text-is('Budget') + dd")).to_have_text("1 of 1 attempt(s) used since its last redrive")
    expect(p.locator("dl.summary dt:text-is('History') + dd")).to_have_text("2 attempt(s) in all, below")
    second = p.locator("ol.timeline > li").nth(1)
    expect(second.locator(".life-break")).to_contain_text("Redriven: a fresh budget starts with this attempt")
    expect(p.locator("ol.timeline > li").first.locator(".life-break")).to_have_count(0)
    check_and_shoot(view, "task-redriven")


def test_views_a_dead_task_is_redriven_from_its_own_page_by_keyboard(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/tasks/{scene['ids']['dead']}")
    expect(p.get_by_role("heading", name="Why it is dead")).to_be_visible()
    check_and_shoot(view, "task-dead")
    redrive = p.get_by_role("button", name="Redrive…")
    # Reached from the top of the page with Tab alone.
    p.locator("#skip-link").focus()
    for _ in range(40):
        if p.evaluate("document.activeElement && document.activeElement.textContent") == "Redrive…":
            break
        p.keyboard.press("Tab")
    expect(redrive).to_be_focused()
    p.keyboard.press("Enter")
    dialog = p.locator("#confirm-dialog")
    expect(dialog).to_contain_text(f"1 task(s) match: task {LONG_ID}")
    assert axe_violations(p) == [], "the confirmation dialog has serious or critical violations"
    expect(p.locator("#confirm-ok")).to_be_focused()
    p.keyboard.press("Enter")
    expect(p.locator("#status-line")).to_have_text("Redrive: 1 task(s) redriven.")
    wait_status(scene["dev"].url, scene["ids"]["dead"], "DEAD")  # console.fail dies again, as it should
    expect(p.locator("dl.summary dt:text-is('Redrives') + dd")).to_have_text("1")


def test_views_a_pending_task_has_cancel_on_its_page(view: Page, scene: dict[str, Any]) -> None:
    p = view.open(f"/tasks/{scene['ids']['pending']}")
    expect(p.get_by_role("button", name="Cancel task")).to_be_visible()
    expect(p.get_by_text("Not run yet: it waits for a worker to claim it.")).to_be_visible()
    check_and_shoot(view, "task-pending")


@pytest.mark.parametrize("route, name, text", [
    ("/operations", "operations", "No operation yet. A redrive, purge or cancel runs here"),
    ("/schedules", "schedules", "No schedule yet. A schedule enqueues a task"),
])
def test_views_empty_views_say_what_fills_them(view: Page, route: str, name: str, text: str) -> None:
    p = view.open(route)
    expect(p.get_by_text(text)).to_be_visible()
    check_and_shoot(view, name)


def test_views_enqueue_and_audit(view: Page) -> None:
    p = view.open("/enqueue")
    expect(p.locator("form.enqueue")).to_be_visible()
    check_and_shoot(view, "enqueue")
    p = view.open("/audit")
    expect(p.locator("table.data tbody tr[data-entry]").first).to_be_visible()
    check_and_shoot(view, "audit")


def test_views_metrics_answers_refuse_bad_input(scene: dict[str, Any]) -> None:
    url = scene["dev"].url
    status, problem = call(url, "GET", f"/v1/queues/{QUEUE}/metrics?window=week")
    assert status == 422 and "window" in json.dumps(problem), problem
    status, problem = call(url, "GET", "/v1/queues/Not%20A%20Queue/metrics")
    assert status == 422, problem
    status, problem = call(url, "GET", "/v1/metrics?since=yesterday")
    assert status == 422, problem
    status, series = call(url, "GET", f"/v1/queues/{QUEUE}/metrics?window=day")
    assert status == 200 and series["step_seconds"] == 300 and len(series["minutes"]) in (288, 289)
    assert all(len(h["p99_ms"]) == len(series["minutes"]) for h in series["handlers"])
