"""The browser fixtures of the playground tests: headless Chromium through Playwright
(Debian's /usr/bin/chromium, not a downloaded browser); without the ``playwright`` package
or ``/usr/bin/chromium`` the tests that use them skip, saying which is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the playwright package is not installed (pip install playwright; "
        "no 'playwright install' needed: the tests use Debian's chromium)",
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page; fails the test on any uncaught JavaScript error."""
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
