"""celery_emq attaches to Flower applications built after or before it met Flower."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

pytest.importorskip("flower")
from flower.app import Flower
from flower.options import default_options
from prometheus_client import REGISTRY
from tornado.httputil import HTTPHeaders, HTTPServerRequest, RequestStartLine

from celery_emq.ops import flower as emq_flower
from celery_emq.ops.metrics import EmqCollector
from celery_emq.ops.morgue_page import JobPage, MorguePage, Retry


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Leave prometheus_client's default registry as it was."""
    before = emq_flower._collector
    yield
    if emq_flower._collector is not None and emq_flower._collector is not before:
        REGISTRY.unregister(emq_flower._collector)
    emq_flower._collector = before


def handler_of(app: Flower, path: str) -> Any:
    return app.find_handler(
        HTTPServerRequest(
            start_line=RequestStartLine("GET", path, "HTTP/1.1"),
            headers=HTTPHeaders({"Host": "127.0.0.1"}),
        )
    ).handler_class


def options(url_prefix: str) -> SimpleNamespace:
    return SimpleNamespace(**{**default_options.as_dict(), "url_prefix": url_prefix})


def test_a_flower_built_after_register_gets_the_page_and_the_collector(
    app: Celery, fresh_registry: None
) -> None:
    assert emq_flower.register()
    emq_flower._collector = None
    flower_app = Flower(capp=app, options=options(""))
    assert handler_of(flower_app, "/emq") is MorguePage
    assert handler_of(flower_app, "/emq/job/celery/j1") is JobPage
    assert handler_of(flower_app, "/emq/retry") is Retry
    # Flower's own pages still answer.
    assert handler_of(flower_app, "/workers").__name__ == "WorkersView"
    assert isinstance(emq_flower._collector, EmqCollector)
    assert emq_flower._collector.source is flower_app.emq_store


def test_a_flower_built_before_gets_them_when_register_runs(
    app: Celery, fresh_registry: None
) -> None:
    emq_flower._collector = None
    # Built as `celery flower` builds it when celery_emq was imported before Flower
    # (the command loads its plugins in either order): Flower's own constructor.
    flower_app = Flower.__new__(Flower)
    init = Flower.__init__
    getattr(init, "__wrapped__", init)(flower_app, capp=app, options=options("flower"))
    assert handler_of(flower_app, "/flower/emq") is not MorguePage
    emq_flower._hook_flower_app()
    assert handler_of(flower_app, "/flower/emq") is MorguePage
    assert handler_of(flower_app, "/flower/emq/job/q/j") is JobPage
    assert emq_flower._collector is not None
    assert emq_flower._collector.source is flower_app.emq_store
