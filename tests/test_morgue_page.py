"""The ``/emq`` page served by a Flower application in this process, over real HTTP."""

from __future__ import annotations

import asyncio
import http.cookiejar
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

pytest.importorskip("flower")
from flower.app import Flower
from flower.options import default_options
from flower.urls import settings as flower_settings

from celery_emq.ops import flower as emq_flower
from celery_emq.store.jobstore import JobStore
from tests.test_flower_attach import fresh_registry
from tests.test_morgue import kill, snapshot

__all__ = ["fresh_registry"]  # the fixture each Flower here registers its collector under


class Browser:
    """Requests to one Flower, keeping its cookies (the XSRF token's)."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base + path, timeout=10) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, fields: list[tuple[str, str]]) -> tuple[int, str]:
        _, page = self.get("/emq")
        token = re.search(r'name="_xsrf" value="([^"]+)"', page)
        assert token is not None
        data = urllib.parse.urlencode([("_xsrf", token.group(1)), *fields]).encode()
        try:
            with self.opener.open(self.base + path, data=data, timeout=10) as r:
                return int(r.status), r.geturl()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@pytest.fixture
def browser(app: Celery, fresh_registry: None) -> Iterator[Browser]:
    """A Flower application with the page attached, served on a free port."""
    emq_flower.register()
    options = SimpleNamespace(**{**default_options.as_dict(), "url_prefix": ""})
    flower_app = Flower(capp=app, options=options, **flower_settings)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    servers: list[Any] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        servers.append(flower_app.listen(0, address="127.0.0.1"))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    [server] = servers
    port = next(iter(server._sockets.values())).getsockname()[1]
    try:
        yield Browser(port)
    finally:
        loop.call_soon_threadsafe(server.stop)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        flower_app.emq_store.reset()


def test_a_queue_name_with_a_slash_lists_and_shows(
    app: Celery, store: JobStore, browser: Browser
) -> None:
    a = kill(app, store, "proj.a", queue="jobs/images", when_ms=1_767_323_045_000)
    status, page = browser.get("/emq")
    assert status == 200
    link = re.search(r'class="job-link" href="([^"]+)"', page)
    assert link is not None
    status, job = browser.get(link.group(1).replace("&amp;", "&"))
    assert status == 200, job
    assert a in job and "jobs/images" in job
    # Times read as dates, not epochs: the death and each stall of the history.
    assert "2026-01-02 03:04:05" in job and "1767323045" not in job


def test_a_rejected_jobs_time_reads_as_a_date(
    app: Celery, store: JobStore, browser: Browser
) -> None:
    app.send_task("proj.r", args=(1,))
    [job] = store.claim("celery", "w", now_ms=1_767_323_040_000)
    store.register("celery")
    store.bury(
        "celery",
        job.id,
        job.token,
        "rejected",
        "rejected without requeue",
        now_ms=1_767_323_045_000,
    )
    for path in ("/emq", f"/emq/job?queue=celery&id={job.id}"):
        status, page = browser.get(path)
        assert status == 200 and "rejected" in page
        assert "2026-01-02 03:04:05" in page and "1767323" not in page


def test_notices_come_from_a_fixed_list(browser: Browser) -> None:
    status, page = browser.get("/emq?" + urllib.parse.urlencode({"notice": "Send money to X"}))
    assert status == 200
    assert "Send money" not in page and 'id="notice"' not in page
    _, page = browser.get("/emq?notice=retried")
    assert re.search(r'id="notice"[^>]*>\s*Retried the selected job', page)


def test_flowers_own_pages_link_to_the_page(browser: Browser) -> None:
    status, page = browser.get("/no-such-page")
    assert status == 404
    assert page.count('<a class="nav-link" href="/emq">Morgue</a>') == 1


def test_an_unknown_id_changes_nothing(
    app: Celery, store: JobStore, client: redis.Redis, prefix: str, browser: Browser
) -> None:
    a = kill(app, store, "proj.a", when_ms=10_000)
    before = snapshot(client, prefix)
    status, url = browser.post("/emq/retry", [("id", a), ("id", "nope")])
    assert status == 200 and url.endswith("/emq?notice=missing")
    status, url = browser.post("/emq/purge", [("id", a), ("id", "nope")])
    assert status == 200 and url.endswith("/emq?notice=missing")
    assert snapshot(client, prefix) == before
    _, page = browser.get("/emq?notice=missing")
    assert "Nothing changed" in page
    status, url = browser.post("/emq/retry", [("id", a)])
    assert status == 200 and url.endswith("/emq?notice=retried")
    assert store.counts("celery")["pending"] == 1


def test_a_button_with_no_job_selected_changes_nothing(
    app: Celery, store: JobStore, client: redis.Redis, prefix: str, browser: Browser
) -> None:
    # An empty selection is nothing, never the whole morgue.
    kill(app, store, "proj.a", when_ms=10_000)
    before = snapshot(client, prefix)
    for path in ("/emq/retry", "/emq/purge"):
        for fields in ([], [("id", " ")], [("queue", "celery")]):
            status, body = browser.post(path, fields)
            assert status == 400 and "no job selected" in body, (path, fields)
    assert snapshot(client, prefix) == before


def test_flowers_menu_links_to_the_page(app: Celery, fresh_registry: None) -> None:
    emq_flower.register()
    options = SimpleNamespace(**{**default_options.as_dict(), "url_prefix": "flower"})
    flower_app = Flower(capp=app, options=options, **flower_settings)
    loader = flower_app.settings["template_loader"]
    navbar = loader.load("navbar.html").generate(
        reverse_url=lambda name: f"/flower/{name}",
        static_url=lambda path: path,
        active_tab="workers",
        handler=SimpleNamespace(application=flower_app),
        current_user=None,
    )
    link = b'<a class="nav-link" href="/flower/emq">Morgue</a>'
    # In the first menu, after Broker and before the secondary menu (theme, docs).
    assert navbar.count(link) == 1
    assert navbar.index(b">Broker</a>") < navbar.index(link) < navbar.index(b"app-nav-secondary")
