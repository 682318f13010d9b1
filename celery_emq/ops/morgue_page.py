"""The morgue page inside Flower: queue depths, dead jobs, a job's detail, retry and purge.

Served by Flower itself at ``/emq`` once celery_emq attaches to it
(:func:`celery_emq.ops.flower.attach`); nothing else runs. The handlers are Flower's
own (:class:`flower.views.BaseHandler`), so Flower's authentication applies:
every page and button needs the user Flower lets in. The buttons are forms
that POST with Tornado's XSRF token, checked whatever Flower's authentication
(Flower itself checks the token only under OAuth). Pages are rendered on the
server from templates shipped in ``celery_emq/ops/templates/emq``, without scripts.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import tornado.template
import tornado.web
from flower.views import BaseHandler
from tornado.ioloop import IOLoop

from celery_emq.errors import EmqError, UnknownJobError
from celery_emq.ops.format import age, parse_time, when
from celery_emq.ops.morgue import REASONS, Morgue
from celery_emq.store.status import queue_statuses
from celery_emq.transport.jobs import accepted_content

__all__ = ["LIST_LIMIT", "NOTICES", "FlowerTemplates", "handlers", "loader_options"]

#: Most dead jobs the list shows (the newest deaths first).
LIST_LIMIT = 500

#: What the page may say after a button: ``?notice=`` picks one by its key, so a
#: link cannot put words of its own on the page.
NOTICES = {
    "retried": "Retried the selected job(s): back at the front of their queues.",
    "purged": "Purged the selected job(s).",
    "missing": (
        "Nothing changed: a selected job is no longer in the morgue "
        "(retried, purged or trimmed meanwhile)."
    ),
}

TEMPLATES = str(Path(__file__).parent / "templates" / "emq")

T = TypeVar("T")


def loader_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The template options of a Tornado application's settings (as Tornado reads them)."""
    options = {}
    if "autoescape" in settings:
        options["autoescape"] = settings["autoescape"]
    if "template_whitespace" in settings:
        options["whitespace"] = settings["template_whitespace"]
    return options


class FlowerTemplates(tornado.template.Loader):
    """Flower's own templates, read as they are but for one more item in Flower's menu.

    The item (a link to the morgue page) goes at the end of the first list of
    ``navbar.html``, after Workers, Tasks and Broker. A navbar without such a
    list is left as it is.
    """

    MENU = "navbar.html"

    def __init__(self, root_directory: str, link: str, **kwargs: Any) -> None:
        super().__init__(root_directory, **kwargs)
        self.link = link

    def _create_template(self, name: str) -> tornado.template.Template:
        if name != self.MENU:
            return super()._create_template(name)
        with open(Path(self.root) / name, encoding="utf-8") as f:
            text = f.read()
        item = (
            '<li class="nav-item"><a class="nav-link" '
            f'href="{html.escape(self.link)}">Morgue</a></li>\n'
        )
        end = text.find("</ul>")
        if end >= 0:
            text = text[:end] + item + text[end:]
        return tornado.template.Template(text, name=name, loader=self)


class EmqHandler(BaseHandler):  # type: ignore[misc]
    """What the morgue pages share: templates, the store, blocking calls off the loop."""

    #: Set while one of our pages renders; Flower's error pages come from its own templates.
    _ours = False

    def get_template_path(self) -> str | None:
        return TEMPLATES if self._ours else super().get_template_path()

    def create_template_loader(self, template_path: str) -> tornado.template.BaseLoader:
        # Flower's templates may come from the application's loader (its menu
        # with our link); ours never do.
        if template_path == TEMPLATES:
            return tornado.template.Loader(template_path, **loader_options(self.settings))
        loader: tornado.template.BaseLoader = super().create_template_loader(template_path)
        return loader

    @property
    def root(self) -> str:
        """The page's own path (``/emq``, under Flower's ``url_prefix`` if any)."""
        prefix = (self.application.options.url_prefix or "").strip("/")
        return f"/{prefix}/emq" if prefix else "/emq"

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on Flower's executor, not on its event loop."""
        return await IOLoop.current().run_in_executor(None, fn, *args)

    def morgue(self) -> Morgue:
        return Morgue(self.application.emq_store.get(), accepted_content(self.capp))

    def arg(self, name: str) -> str | None:
        """A query or form argument as typed (templates escape what they show)."""
        value = self.get_argument(name, None, escape=False)
        return value.strip() or None if value is not None else None

    def page(self, template: str, **kwargs: Any) -> None:
        self._ours = True
        try:
            self.render(template, root=self.root, when=when, age=lambda ms: age(ms, " "), **kwargs)
        finally:
            self._ours = False


class MorguePage(EmqHandler):
    """``GET /emq``: every queue's depths, and the dead jobs matching the filters."""

    @tornado.web.authenticated
    async def get(self) -> None:
        filters = {k: self.arg(k) for k in ("queue", "task", "reason", "since")}
        error = None
        try:
            queues, jobs = await self.blocking(self._read, filters)
        except (EmqError, ValueError) as exc:
            queues, jobs, error = [], [], str(exc)
        reasons = [*REASONS, *sorted({j.reason for j in jobs} - set(REASONS))]
        self.page(
            "morgue.html",
            queues=queues,
            jobs=jobs,
            filters=filters,
            reasons=reasons,
            limit=LIST_LIMIT,
            notice=NOTICES.get(self.arg("notice") or ""),
            error=error,
        )

    def _read(self, filters: dict[str, str | None]) -> tuple[list[dict[str, Any]], list[Any]]:
        morgue = self.morgue()
        store = morgue.store
        names = store.queues()
        since_ms = None
        if filters["since"]:
            since_ms = _since_ms(filters["since"], store.server_ms)
        jobs = morgue.ls(
            queue=filters["queue"],
            task=filters["task"],
            reason=filters["reason"],
            since_ms=since_ms,
        )
        jobs.reverse()  # the latest deaths first
        return queue_statuses(store, names), jobs[:LIST_LIMIT]


class JobPage(EmqHandler):
    """``GET /emq/job?queue=<queue>&id=<id>``: one dead job: task, arguments, error, history.

    The queue and the id are query arguments, so any queue name works (one
    holding ``/`` as well); ``/emq/job/<queue>/<id>`` still answers for names
    without one.
    """

    @tornado.web.authenticated
    async def get(self, queue: str | None = None, job_id: str | None = None) -> None:
        queue = queue or self.arg("queue")
        job_id = job_id or self.arg("id")
        if not (queue and job_id):
            raise tornado.web.HTTPError(400, "the page of a dead job needs queue and id")
        job = await self.blocking(lambda: self.morgue().show(job_id, queue))
        if job is None:
            raise tornado.web.HTTPError(404, f"no dead job {job_id!r} in queue {queue!r}")
        self.page("job.html", job=job)


class Action(EmqHandler):
    """``POST /emq/retry`` and ``POST /emq/purge``: the buttons (form fields ``id``, ``queue``)."""

    verb = ""

    def check_xsrf_cookie(self) -> None:
        # Flower's check stops at its cross-site rules unless OAuth is on; ours
        # always wants the token as well.
        super().check_xsrf_cookie()
        tornado.web.RequestHandler.check_xsrf_cookie(self)

    @tornado.web.authenticated
    async def post(self) -> None:
        if not self.settings.get("xsrf_cookies"):
            self.check_xsrf_cookie()
        ids = [i.strip() for i in self.get_arguments("id") if i.strip()]
        if not ids:
            raise tornado.web.HTTPError(400, "no job selected")
        queue = self.arg("queue")
        try:
            await self.blocking(self._act, ids, queue)
            notice = {"retry": "retried", "purge": "purged"}[self.verb]
        except UnknownJobError:
            notice = "missing"
        self.redirect(self.root + "?" + urlencode({"notice": notice}))

    def _act(self, ids: list[str], queue: str | None) -> None:
        """Retry or purge every id given, or none of them if one is not dead."""
        morgue = self.morgue()
        if self.verb == "retry":
            morgue.retry(ids, rate_per_s=None, queue=queue)
        else:
            morgue.purge(ids, queue=queue)


class Retry(Action):
    verb = "retry"


class Purge(Action):
    verb = "purge"


def _since_ms(text: str, server_ms: Callable[[], int]) -> int:
    """Read ``since``: a duration ago (``90s``, ``30m``, ``2h``, ``7d``) or an ISO-8601 time."""
    try:
        ms, ago = parse_time(text)
    except ValueError as exc:
        raise ValueError(f"since: {exc}") from None
    return server_ms() - ms if ago else ms


def handlers() -> list[tuple[str, type[EmqHandler]]]:
    """The page's routes, relative to Flower's root."""
    return [
        (r"/emq/?", MorguePage),
        (r"/emq/job/?", JobPage),
        (r"/emq/job/([^/]+)/([^/]+)", JobPage),
        (r"/emq/retry", Retry),
        (r"/emq/purge", Purge),
    ]
