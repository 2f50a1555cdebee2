"""The operator console in chromium, end to end against ``rdq dev`` (SQLite, a subprocess) and
through ``rdq console`` in front of a SigV4-verifying proxy. Every wait is on a condition with a
deadline (Playwright's ``expect`` and ``wait_until``); screenshots go to ``artifacts/``."""

from __future__ import annotations

import contextlib
import json
import http.client
import re
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from tests.browser.conftest import (
    FAILURE_TYPE, HANDLERS, WAIT_MS, ConsoleProcess, Page, call, fresh_queue, task_status, wait_status,
)
from tests.rdq_servers import ACCESS_KEY, REGION, SECRET_KEY, DevServer, Proxy


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


def enqueue_from_form(p: Any, queue: str, handler: str, payload: str, *, task_id: str = "",
                      max_attempts: str = "", delay: str = "") -> None:
    form = p.locator("form.enqueue")
    form.get_by_label("Queue", exact=True).fill(queue)
    form.get_by_label("Handler", exact=True).fill(handler)
    form.get_by_label("Payload (JSON)").fill(payload)
    form.get_by_label("Delay in seconds (optional)").fill(delay)
    form.get_by_label("Max attempts (optional)").fill(max_attempts)
    form.get_by_label("Task id (optional)").fill(task_id)
    form.get_by_role("button", name="Enqueue").click()


def test_enqueue_from_the_form_and_watch_the_task_succeed_on_its_page(page: Page) -> None:
    queue, task_id = fresh_queue("form"), fresh_queue("form-task")
    p = page.open("/enqueue")
    expect(p.get_by_role("heading", name="Enqueue a task")).to_be_visible()
    payload = p.get_by_label("Payload (JSON)")
    enqueue_from_form(p, queue, "console.ok", '{"name": "Ada"', task_id=task_id)  # not JSON yet
    expect(p.get_by_text("The payload is not valid JSON")).to_be_visible()
    expect(payload).to_have_attribute("aria-invalid", "true")
    expect(payload).to_be_focused()
    page.shoot("enqueue-invalid-json")
    assert call(page.base_url, "GET", f"/v1/tasks/{task_id}")[0] == 404  # nothing was sent

    payload.fill('{"name": "Ada", "note": "<img src=x onerror=alert(1)>"}')
    p.get_by_role("button", name="Enqueue").click()
    expect(p).to_have_url(re.compile(re.escape(f"#/tasks/{task_id}") + "$"))
    expect(p.get_by_role("heading", name=f"Task {task_id}")).to_be_visible()
    expect(p.locator("dl.summary")).to_contain_text("SUCCEEDED", timeout=WAIT_MS)
    expect(p.get_by_role("heading", name="Attempt 1: SUCCESS")).to_be_visible()
    expect(p.locator("pre.result")).to_contain_text('"name": "Ada"')
    expect(p.locator("pre.payload")).to_contain_text("<img src=x onerror=alert(1)>")  # as text
    assert p.locator("#view img").count() == 0
    expect(p.get_by_role("status")).to_contain_text(f"Task {task_id} enqueued on {queue}")
    page.shoot("task-succeeded")


def test_a_worker_name_shows_as_text_on_the_running_task(page: Page) -> None:
    # A worker names itself (any printable text): markup in it must stay text. The task is real
    # (pending, an hour out); the API's answer is given the running claim a hostile worker made.
    queue = fresh_queue("claimer")
    status, task = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.ok", "delay_seconds": 3600})
    assert status == 201, task
    hostile = '<img src=x onerror="window.__pwned=1">"; alert(1) //'
    running = {**task, "status": "IN_FLIGHT", "claimed_at": task["created_at"], "lease_expires_at": task["next_attempt_at"],
               "claimed_by": hostile}

    def answer(route: Any) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(running))

    page.page.route(re.compile(re.escape(f"/v1/tasks/{task['id']}") + r"(\?.*)?$"), answer)
    p = page.open(f"/tasks/{task['id']}")
    section = p.locator("section.running")
    expect(section.locator("dt:text-is('Worker') + dd")).to_have_text(hostile)
    expect(section.locator("img")).to_have_count(0)
    assert p.evaluate("() => window.__pwned") is None


def test_a_failing_task_dead_letters_is_found_by_error_type_and_redriven_through_the_dialog(page: Page) -> None:
    queue, task_id = fresh_queue("dlq"), fresh_queue("dlq-task")
    other = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks",
                 {"handler": "console.not-registered", "max_attempts": 1})[1]["id"]
    p = page.open(f"/enqueue?queue={queue}")
    expect(p.get_by_label("Queue", exact=True)).to_have_value(queue)
    enqueue_from_form(p, queue, "console.fail", '{"order": 7}', task_id=task_id, max_attempts="1")
    expect(p.locator("dl.summary")).to_contain_text("DEAD", timeout=WAIT_MS)
    attempts = p.locator("ol.timeline > li")
    expect(attempts).to_have_count(1)
    expect(attempts.first.locator(".error-type")).to_have_text(FAILURE_TYPE)
    expect(attempts.first.locator(".error-message")).to_have_text("stage <b>two</b> failed on attempt 1")
    assert p.locator("#view b").count() == 0  # the handler's markup stayed text
    wait_status(page.base_url, other, "DEAD")

    p.get_by_role("link", name="Open the dead-letter queue").click()
    expect(p.get_by_role("heading", name=f"Dead-letter queue of {queue}")).to_be_visible()
    rows = p.locator("table.data:not(.handlers) tbody tr")
    expect(rows).to_have_count(2)
    p.get_by_label("Error type").fill(FAILURE_TYPE)
    p.get_by_role("button", name="Apply filters").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-task", task_id)
    expect(p.locator("#dlq-scope")).to_contain_text(f"every dead task with error type {FAILURE_TYPE}")
    page.shoot("dlq-filtered")

    dialog = p.locator("#confirm-dialog")
    p.get_by_label(f"Select task {task_id}").check()  # a selection by id wins over the filters
    expect(p.locator("#dlq-scope")).to_contain_text("the 1 selected task(s)")
    p.get_by_role("button", name="Purge…").click()
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("1 task(s) match: the 1 selected task(s)")
    expect(p.locator("#confirm-cancel")).to_be_focused()  # a destructive action starts on Cancel
    p.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(p.get_by_role("button", name="Purge…")).to_be_focused()
    assert task_status(page.base_url, task_id) == "DEAD"  # Escape changed nothing
    p.get_by_label(f"Select task {task_id}").uncheck()

    p.get_by_role("button", name="Redrive…").click()
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("1 task(s) match")
    expect(dialog).to_contain_text(FAILURE_TYPE)
    page.shoot("dlq-confirm-redrive")
    dialog.get_by_role("button", name="Redrive 1").click()
    expect(dialog).to_be_hidden()
    expect(p.get_by_role("status")).to_contain_text("1 task(s) redriven")
    assert task_status(page.base_url, other) == "DEAD"  # outside the filter: untouched

    # It runs again (a fresh budget of one attempt), fails again, and is dead with both attempts.
    p = page.open(f"/tasks/{task_id}")
    expect(p.locator("ol.timeline > li")).to_have_count(2, timeout=WAIT_MS)
    expect(p.locator("dl.summary")).to_contain_text("DEAD", timeout=WAIT_MS)
    second = p.locator("ol.timeline > li").nth(1)
    expect(second.locator(".error-message")).to_have_text("stage <b>two</b> failed on attempt 1")
    expect(second.locator(".duration")).to_have_text(re.compile(r"^\d+(\.\d+)? (ms|s)$"))
    expect(p.locator("dl.summary dt:text-is('Redrives') + dd")).to_have_text("1")
    second.locator("summary").click()
    expect(second.locator("pre.stack")).to_contain_text("PipelineBroken")
    page.shoot("task-timeline")


def test_a_paused_queue_keeps_its_tasks_pending_until_resumed(page: Page) -> None:
    queue, marker_queue = fresh_queue("pause"), fresh_queue("marker")
    first = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.ok"})[1]["id"]
    wait_status(page.base_url, first, "SUCCEEDED")
    p = page.open("/queues")
    row = p.locator(f'tr[data-queue="{queue}"]')
    row.get_by_role("button", name=f"Pause queue {queue}").click()
    expect(row.get_by_role("button", name=f"Resume queue {queue}")).to_be_visible()
    expect(row).to_contain_text("paused")
    expect(p.get_by_role("status")).to_contain_text(f"Queue {queue} paused")

    held = [call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.ok"})[1]["id"] for _ in range(2)]
    marker = call(page.base_url, "POST", f"/v1/queues/{marker_queue}/tasks", {"handler": "console.ok"})[1]["id"]
    wait_status(page.base_url, marker, "SUCCEEDED")  # the worker has run since they were enqueued
    assert [task_status(page.base_url, task) for task in held] == ["PENDING", "PENDING"]
    expect(row.locator("td[data-col=pending]")).to_have_text("2", timeout=WAIT_MS)  # by the overview's own refresh
    page.shoot("queues-paused")

    p.get_by_role("link", name=queue, exact=True).click()
    expect(p.get_by_role("heading", name=f"Tasks in {queue}")).to_be_visible()
    p.get_by_label("Status").select_option("PENDING")
    p.get_by_role("button", name="Apply filters").click()
    rows = p.locator("table.data:not(.handlers) tbody tr")
    expect(rows).to_have_count(2)
    assert sorted(rows.nth(i).get_attribute("data-task") or "" for i in range(2)) == sorted(held)
    page.shoot("tasks-pending")

    p = page.open("/queues")
    row = p.locator(f'tr[data-queue="{queue}"]')
    row.get_by_role("button", name=f"Resume queue {queue}").click()
    expect(row.get_by_role("button", name=f"Pause queue {queue}")).to_be_visible()
    for task in held:
        wait_status(page.base_url, task, "SUCCEEDED")
    expect(row.locator("td[data-col=pending]")).to_have_text("0", timeout=WAIT_MS)
    expect(row.locator("td[data-col=succeeded]")).to_have_text("3", timeout=WAIT_MS)


def test_pending_tasks_are_cancelled_by_handler_after_the_dry_run_count(page: Page) -> None:
    queue = fresh_queue("cancel")
    later = {"delay_seconds": 3600}
    doomed = [call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.ok", **later})[1]["id"]
              for _ in range(2)]
    kept = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.fail", **later})[1]["id"]
    p = page.open(f"/queues/{queue}/tasks?handler=console.ok")
    rows = p.locator("table.data:not(.handlers) tbody tr")
    expect(rows).to_have_count(2)
    p.get_by_role("button", name="Cancel pending…").click()
    dialog = p.locator("#confirm-dialog")
    expect(dialog).to_contain_text("2 task(s) match: every PENDING task with handler console.ok")
    page.shoot("tasks-cancel-confirm")
    dialog.get_by_role("button", name="Cancel 2").click()
    expect(p.get_by_role("status")).to_contain_text("Cancelled: 2 task(s).")
    assert [task_status(page.base_url, task) for task in doomed] == ["CANCELLED", "CANCELLED"]
    assert task_status(page.base_url, kept) == "PENDING"
    expect(rows.first.locator("td").first).to_have_text("CANCELLED")  # the list reloaded


def test_a_bulk_cancel_too_large_for_one_request_is_followed_as_an_operation(page: Page) -> None:
    queue = fresh_queue("bulk")
    for _ in range(3):  # 1,200 pending tasks: more than the API acts on inline
        call(page.base_url, "POST", f"/v1/queues/{queue}/tasks:batch",
             {"tasks": [{"handler": "console.ok", "delay_seconds": 3600} for _ in range(400)]})
    p = page.open(f"/queues/{queue}/tasks")
    p.get_by_role("button", name="Cancel pending…").click()
    dialog = p.locator("#confirm-dialog")
    expect(dialog).to_contain_text("1200 task(s) match")
    dialog.get_by_role("button", name="Cancel 1200").click()
    expect(p.get_by_role("status")).to_contain_text("Cancelled: 1200 task(s).", timeout=WAIT_MS * 2)
    status, operations = call(page.base_url, "GET", f"/v1/operations?queue={queue}")
    assert status == 200 and [(o["action"], o["status"], o["done"]) for o in operations["operations"]] == [
        ("cancel", "SUCCEEDED", 1200)]


def test_the_operations_view_shows_a_running_operation_and_cancels_it(page: Page) -> None:
    queue = fresh_queue("ops")
    call(page.base_url, "POST", f"/v1/queues/{queue}/tasks:batch",
         {"tasks": [{"handler": "console.ok", "delay_seconds": 3600} for _ in range(200)]})
    status, started = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks:cancel",
                           {"all": True, "rate_per_second": 2})  # slow on purpose: it is still running
    assert status == 202
    operation = started["operation"]["id"]
    p = page.open(f"/operations?queue={queue}")
    row = p.locator(f"tr[data-operation='{operation}']")
    expect(row).to_contain_text("RUNNING")
    expect(row).to_contain_text("cancel")
    page.shoot("operations-running")
    row.get_by_role("button", name=f"Cancel operation {operation}").click()
    expect(p.get_by_role("status")).to_contain_text(f"Operation {operation} cancelled")
    expect(row).to_contain_text("CANCELLED")
    status, shown = call(page.base_url, "GET", f"/v1/operations/{operation}")
    assert status == 200 and shown["status"] == "CANCELLED" and shown["done"] < 200


def test_the_task_list_pages_by_cursor(page: Page) -> None:
    queue = fresh_queue("pages")
    batch = {"tasks": [{"handler": "console.ok", "delay_seconds": 3600, "payload": {"n": n}} for n in range(55)]}
    assert call(page.base_url, "POST", f"/v1/queues/{queue}/tasks:batch", batch)[0] == 200
    p = page.open(f"/queues/{queue}/tasks?status=PENDING")
    rows = p.locator("table.data:not(.handlers) tbody tr")
    expect(rows).to_have_count(50)
    first_page = {rows.nth(i).get_attribute("data-task") for i in range(50)}
    expect(p.get_by_role("button", name="First page")).to_be_disabled()
    p.get_by_role("button", name="Next page").click()
    expect(rows).to_have_count(5)
    expect(p.locator("table.data:not(.handlers) caption")).to_contain_text("(page 2)")
    expect(p.get_by_role("button", name="Next page")).to_be_disabled()
    second_page = {rows.nth(i).get_attribute("data-task") for i in range(5)}
    assert len(first_page | second_page) == 55  # no task twice, none missed
    p.get_by_role("button", name="First page").click()
    expect(rows).to_have_count(50)
    call(page.base_url, "POST", f"/v1/queues/{queue}/tasks:cancel", {"all": True})


def test_the_audit_view_lists_the_redrive_and_the_pause_with_actor_local(page: Page) -> None:
    queue = fresh_queue("audit")
    dead = call(page.base_url, "POST", f"/v1/queues/{queue}/tasks", {"handler": "console.fail", "max_attempts": 1})[1]["id"]
    wait_status(page.base_url, dead, "DEAD")
    assert call(page.base_url, "POST", f"/v1/queues/{queue}/dlq:redrive", {"ids": [dead]}) == (200, {"redriven": 1})
    assert call(page.base_url, "POST", f"/v1/queues/{queue}:pause", {})[0] == 200
    try:
        p = page.open(f"/audit?queue={queue}")
        expect(p.get_by_role("heading", name="Audit log")).to_be_visible()
        rows = p.locator("table.data:not(.handlers) tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_contain_text(re.compile("pause", re.IGNORECASE))  # newest first
        expect(rows.nth(1)).to_contain_text(re.compile("redrive", re.IGNORECASE))
        for i in range(2):
            expect(rows.nth(i).locator("td").nth(1)).to_have_text("local")
            expect(rows.nth(i).locator("td").nth(3)).to_have_text(queue)
        expect(rows.nth(1).locator("td").nth(5)).to_have_text("1")
        expect(rows.nth(1)).to_contain_text(dead)  # the selection names the redriven id
        page.shoot("audit")
    finally:
        call(page.base_url, "POST", f"/v1/queues/{queue}:resume", {})


def test_api_errors_are_shown_in_a_labelled_alert(page: Page) -> None:
    p = page.open("/tasks/no-such-task-42")
    alert = p.get_by_role("alert", name="Error")
    expect(alert).to_be_visible()
    expect(alert).to_contain_text("404")
    expect(alert).to_contain_text("no-such-task-42")
    page.shoot("error-alert")

    p = page.open("/enqueue")
    enqueue_from_form(p, fresh_queue("invalid"), "console.ok", "{}", max_attempts="0")
    expect(alert).to_contain_text("422")
    expect(alert).to_contain_text("max_attempts")
    expect(p.get_by_label("Max attempts (optional)")).to_have_attribute("aria-invalid", "true")
    p.get_by_role("button", name="Dismiss").click()
    expect(alert).to_be_hidden()


def test_the_console_is_keyboard_usable(page: Page) -> None:
    p = page.open("/queues")
    expect(p.get_by_role("heading", name="Queues")).to_be_visible()
    p.keyboard.press("Tab")
    expect(p.get_by_role("link", name="Skip to content")).to_be_focused()
    p.keyboard.press("Enter")
    expect(p.get_by_role("heading", name="Queues")).to_be_focused()
    p.get_by_role("link", name="Enqueue", exact=True).focus()
    outline = p.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"  # a visible focus ring
    p.keyboard.press("Enter")
    expect(p.get_by_role("heading", name="Enqueue a task")).to_be_focused()  # focus follows the route
    expect(p.get_by_role("link", name="Enqueue", exact=True)).to_have_attribute("aria-current", "page")
    page.shoot("keyboard-enqueue")


def test_with_a_token_the_page_is_served_and_asks_for_the_token(browser: Any, tmp_path: Path) -> None:
    token = "console-token-5"
    server = DevServer(tmp_path, token=token, handlers=HANDLERS)
    page = Page(browser, server.url)
    try:
        with urllib.request.urlopen(f"{server.url}/", timeout=10) as response:  # no token needed
            assert response.status == 200 and b"rdq console" in response.read()
        assert call(server.url, "GET", "/v1/queues")[0] == 401
        p = page.open("/queues")
        dialog = p.locator("#token-dialog")
        expect(dialog).to_be_visible()
        expect(p.get_by_label("Token", exact=True)).to_be_focused()
        page.shoot("token-dialog")
        p.get_by_label("Token", exact=True).fill("not-the-token")
        p.get_by_role("button", name="Use token").click()
        expect(p.get_by_role("alert")).to_contain_text("401")
        expect(dialog).to_be_visible()  # asked again
        p.get_by_label("Token", exact=True).fill(token)
        p.get_by_role("button", name="Use token").click()
        expect(dialog).to_be_hidden()
        expect(p.locator("table.data caption")).to_contain_text("Queues")
        expect(p.get_by_role("alert")).to_be_hidden()
        assert p.evaluate("sessionStorage.getItem('rdq-console-token')") == token
        p.get_by_role("button", name="Forget token").click()
        assert p.evaluate("sessionStorage.getItem('rdq-console-token')") is None
        assert page.script_errors == []
    finally:
        page.close()
        server.stop()


def test_through_rdq_console_signed_with_sigv4_and_a_wrong_secret_is_refused(
        browser: Any, dev: DevServer, tmp_path: Path) -> None:
    proxy = Proxy(dev, sigv4=True)
    credentials = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    good = ConsoleProcess(tmp_path / "good", proxy.url, "--region", REGION, env=credentials)
    bad = ConsoleProcess(tmp_path / "bad", proxy.url, "--region", REGION,
                         env={**credentials, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    pages = [good.page(browser), bad.page(browser)]
    try:
        signed, refused = pages
        queue, task_id = fresh_queue("signed"), fresh_queue("signed-task")
        p = signed.open("/enqueue")
        enqueue_from_form(p, queue, "console.ok", '{"via": "rdq console"}', task_id=task_id)
        expect(p.locator("dl.summary")).to_contain_text("SUCCEEDED", timeout=WAIT_MS)
        p = signed.open("/queues")
        row = p.locator(f'tr[data-queue="{queue}"]')
        expect(row.locator("td[data-col=succeeded]")).to_have_text("1")
        expect(p.locator("section.overview[data-loaded=hour] canvas")).to_have_count(1)  # the chart's series, signed
        expect(p.get_by_role("alert")).to_be_hidden()
        signed.shoot("console-queues")
        assert ("POST", f"/v1/queues/{queue}/tasks", 201) in proxy.log
        assert ("GET", "/v1/metrics?window=hour", 200) in proxy.log
        assert all(status != 403 for _, _, status in proxy.log)

        p = refused.open("/queues")
        alert = p.get_by_role("alert")
        expect(alert).to_contain_text("403")
        expect(alert).to_contain_text("signature mismatch")
        refused.shoot("console-forbidden")
        assert signed.script_errors == [] and refused.script_errors == []
    finally:
        for page in pages:
            page.close()
        bad.stop()
        good.stop()
        proxy.stop()



class PrefixProxy:
    """Mounts rdq dev under ``/prod`` on another loopback port, as a reverse proxy or an API stage
    would: ``/prod/x`` is forwarded to the dev server's ``/x``, everything else is 404."""

    PREFIX = "/prod"

    def __init__(self, upstream: DevServer) -> None:
        prefix = self.PREFIX

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self.path.startswith(prefix + "/"):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {name: value for name, value in self.headers.items() if name.lower() not in ("host", "origin")}
                connection = http.client.HTTPConnection("127.0.0.1", upstream.port, timeout=15)
                try:
                    connection.request(self.command, self.path[len(prefix):], body=body or None, headers=headers)
                    response = connection.getresponse()
                    payload = response.read()
                    self.send_response(response.status)
                    for name, value in response.getheaders():
                        if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                            self.send_header(name, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                finally:
                    connection.close()

            do_GET = do_HEAD = do_POST = do_DELETE = forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{prefix}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@contextlib.contextmanager
def prefixed(dev: DevServer) -> Iterator[PrefixProxy]:
    proxy = PrefixProxy(dev)
    try:
        yield proxy
    finally:
        proxy.stop()


def test_the_console_works_under_a_path_prefix_and_rdq_console_keeps_the_apis_stage_path(
        browser: Any, dev: DevServer, tmp_path: Path) -> None:
    with prefixed(dev) as proxy:
        queue, task_id = fresh_queue("prefix"), fresh_queue("prefix-task")
        page = Page(browser, proxy.url)  # the page is /prod/, its API calls /prod/v1/...
        try:
            p = page.open("/enqueue")
            enqueue_from_form(p, queue, "console.ok", "{}", task_id=task_id)
            expect(p.locator("dl.summary")).to_contain_text("SUCCEEDED", timeout=WAIT_MS)
            assert page.script_errors == []
        finally:
            page.close()

        console = ConsoleProcess(tmp_path / "stage", proxy.url, "--api-key", "unused-by-rdq-dev",  # rdq --api …/prod console
                                 global_api=True)
        page = console.page(browser)
        try:
            p = page.open(f"/tasks/{task_id}")
            expect(p.locator("dl.summary")).to_contain_text("SUCCEEDED")
            expect(p.get_by_role("alert")).to_be_hidden()
            assert page.script_errors == []
        finally:
            page.close()
            console.stop()
