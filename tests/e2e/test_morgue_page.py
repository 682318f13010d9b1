"""End to end in a real headless Chromium: Flower's ``/emq`` lists a dead job, shows it, retries it.

Needs Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``,
``/usr/bin/chromedriver``) and the ``selenium`` package; skipped without them.
With ``EMQ_DOCS_IMG`` set to a directory, the screenshots of the list and the
detail page are saved there too (``scripts/screenshots`` does that for the docs).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError

from .harness import ROOT, Worker, wait_for
from .test_flower import free_port

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
USER, PASSWORD = "ops", "s3cret"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install ...)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def flower(e2e_env: dict[str, str], tmp_path: Path) -> Iterator[int]:
    """A real ``celery flower`` with basic auth on; yields its port."""
    port = free_port()
    log = tmp_path / "flower.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.e2e.app",
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                f"--basic-auth={USER}:{PASSWORD}",
                f"--db={tmp_path / 'flower.db'}",
            ],
            cwd=ROOT,
            env={**os.environ, **e2e_env},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: status(port, "/healthcheck") == 200, 30, interval=0.3)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def status(port: int, path: str, data: bytes | None = None, auth: bool = False) -> int | None:
    """The HTTP status of one request (no redirects followed), or None if none answered."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    if auth:
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def shot(driver: Any, tmp_path: Path, name: str) -> None:
    """Save a screenshot (and a copy under ``EMQ_DOCS_IMG`` when set); check it is a PNG."""
    path = tmp_path / name
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
    if os.environ.get("EMQ_DOCS_IMG"):
        shutil.copy(path, Path(os.environ["EMQ_DOCS_IMG"]) / name)


def test_morgue_page_lists_shows_and_retries_a_dead_job(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    flower: int,
    browser: Any,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    start_worker("-c", "1")
    result = capp.send_task("tests.e2e.app.poison_until_cured", args=("page",))
    with pytest.raises(StalledJobError):
        result.get(timeout=60)

    # Flower's authentication guards the page and its buttons.
    assert status(flower, "/emq") == 401
    assert status(flower, "/emq", auth=True) == 200
    assert status(flower, "/emq/job/celery/no-such-job", auth=True) == 404
    # A form post with credentials but without the XSRF token is refused.
    form = urllib.parse.urlencode({"id": result.id}).encode()
    assert status(flower, "/emq/retry", data=form, auth=True) == 403
    assert client.zcard(prefix + "emq:{celery}:dead") == 1

    base = f"http://{USER}:{PASSWORD}@127.0.0.1:{flower}"
    browser.get(base + "/emq")
    [row] = browser.find_elements(By.CSS_SELECTOR, f'tr.dead-job[data-task-id="{result.id}"]')
    assert "tests.e2e.app.poison_until_cured" in row.text and "worker_lost" in row.text
    pending = browser.find_element(By.CSS_SELECTOR, '#queue-celery td[data-state="dead"]')
    assert pending.text == "1"
    shot(browser, tmp_path, "morgue-list.png")

    def listed(query: str) -> list[str]:
        browser.get(base + "/emq?" + query)
        return [
            r.get_attribute("data-task-id")
            for r in browser.find_elements(By.CSS_SELECTOR, "tr.dead-job")
        ]

    assert listed("queue=celery&task=tests.e2e.app.poison_until_cured") == [result.id]
    assert listed("reason=worker_lost&since=1h") == [result.id]
    assert listed("reason=malformed") == []
    assert listed("task=tests.e2e.app.add") == []
    assert listed("since=soon") == []
    assert "since" in browser.find_element(By.ID, "error").text
    browser.get(base + "/emq")
    [row] = browser.find_elements(By.CSS_SELECTOR, f'tr.dead-job[data-task-id="{result.id}"]')

    row.find_element(By.CSS_SELECTOR, "a.job-link").click()
    wait_for(lambda: browser.find_elements(By.ID, "job-id"), 10)
    assert browser.find_element(By.ID, "task-id").text == result.id
    assert browser.find_element(By.ID, "args").text == "['page']"
    history = browser.find_elements(By.CSS_SELECTOR, "#history tbody tr")
    assert len(history) == 2 and all("worker_lost" in h.text for h in history)
    assert "stalled 2 times" in browser.find_element(By.ID, "error-text").text
    shot(browser, tmp_path, "morgue-job.png")

    client.set(prefix + "cured:page", 1)
    browser.find_element(By.ID, "retry").click()
    notice = wait_for(lambda: browser.find_elements(By.ID, "notice"), 10)[0]
    assert notice.text.startswith("Retried the selected job(s)")
    # It runs (the ledger counts its third run) and leaves the morgue.
    wait_for(lambda: client.hget(prefix + "runs", "page") == b"3", 30)
    assert capp.AsyncResult(result.id).get(timeout=20) == "cured"
    browser.get(base + "/emq")
    assert browser.find_elements(By.CSS_SELECTOR, "tr.dead-job") == []
    assert browser.find_element(By.ID, "empty").text.startswith("the morgue is empty")
