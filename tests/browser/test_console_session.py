"""``rdq console``'s session token in chromium: the printed address opens a working console and the
token leaves the address bar; a tab without it is asked for it; the token never goes upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.browser.conftest import ConsoleProcess, Page, call
from tests.rdq_servers import DevServer, Proxy


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


def test_the_printed_address_opens_the_console_and_a_tab_without_it_is_asked(browser: Any, dev: DevServer,
                                                                            tmp_path: Path) -> None:
    proxy = Proxy(dev)
    console = ConsoleProcess(tmp_path, proxy.url, "--api-key", "upstream-key-4")
    with_token, without = console.page(browser), Page(browser, console.url)
    try:
        p = with_token.open("/queues")
        expect(p.locator("table.data caption")).to_contain_text("Queues")
        expect(p.get_by_role("alert")).to_be_hidden()
        assert "token=" not in p.url  # out of the address bar and history
        assert p.evaluate("sessionStorage.getItem('rdq-console-token')") == console.token
        assert call(console.url, "GET", "/v1/queues")[0] == 401  # the test itself, without the token
        assert console.token not in repr(proxy.seen)

        q = without.open("/queues")
        expect(q.locator("#token-dialog")).to_be_visible()
        q.get_by_label("Token", exact=True).fill(console.token)
        q.get_by_role("button", name="Use token").click()
        expect(q.locator("#token-dialog")).to_be_hidden()
        expect(q.locator("table.data caption")).to_contain_text("Queues")
        assert with_token.script_errors == [] and without.script_errors == []
    finally:
        with_token.close()
        without.close()
        console.stop()
        proxy.stop()
