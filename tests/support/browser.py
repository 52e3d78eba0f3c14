"""Headless chromium driven by selenium, for the viewer's browser tests (tests/e2e/test_viewer_browser.py).

The browser is Debian's `chromium` with its `chromium-driver` (`make browser` installs both; `make test` depends on
it). Where they are not installed, the tests that need them skip, saying how to install them; selenium is found by
path and never downloads a driver.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "viewer"
MISSING = ("the viewer's browser tests need Debian's chromium and chromium-driver: `make browser` installs them "
           "(apt-get install chromium chromium-driver)")


@contextmanager
def headless_chromium(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1", "--hide-scrollbars"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def wait_ready(browser: Any, timeout: float = 60.0) -> None:
    """Until the page has drawn its document (body[data-ready]); an error the page shows fails the test."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, timeout).until(lambda b: b.execute_script("return document.body.dataset.ready || ''"))
    state = browser.execute_script("return document.body.dataset.ready")
    assert state == "1", browser.find_element("id", "content").text


def screenshot(browser: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    browser.save_screenshot(str(path))
    return path
