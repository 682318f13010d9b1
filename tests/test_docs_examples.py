"""The docs show the example files CI runs, verbatim, in Markdown that GitHub renders too.

A code block that shows an example file follows a marker line naming it::

    <!-- example: examples/testing/tasks.py -->
    ```python
    ...the file, as it is...
    ```

The marker is an HTML comment: neither GitHub nor the built site shows it.
``scripts/docs-examples`` (``python -m tests.test_docs_examples``) copies each
file into its block after an example changed.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BLOCK = re.compile(
    r"^<!-- example: (?P<path>\S+) -->\n(?P<fence>```+)(?P<lang>\w*)\n(?P<body>.*?)^(?P=fence)$",
    re.M | re.S,
)


def blocks(text: str) -> list[re.Match[str]]:
    return list(BLOCK.finditer(text))


def sync(page: Path) -> bool:
    """Copy each example file into its block of ``page``; return whether it changed."""
    text = page.read_text()

    def fill(m: re.Match[str]) -> str:
        body = (ROOT / m["path"]).read_text()
        return f"<!-- example: {m['path']} -->\n{m['fence']}{m['lang']}\n{body}{m['fence']}"

    new = BLOCK.sub(fill, text)
    if new != text:
        page.write_text(new)
    return new != text


def test_no_page_has_a_snippet_line_github_would_show_raw() -> None:
    for page in PAGES:
        assert "--8<--" not in page.read_text(), page.name


def visible(text: str) -> str:
    """What GitHub shows of a page's Markdown: HTML comments hidden."""
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def test_no_page_shows_github_a_build_directive() -> None:
    # mkdocstrings' `::: module` (and its indented options) would read as a
    # paragraph of raw text on GitHub: the API page names its modules in comments.
    for page in PAGES:
        raw = [line for line in visible(page.read_text()).splitlines() if line.startswith(":::")]
        assert raw == [], page.name


def test_the_site_renders_every_module_the_api_page_names() -> None:
    hooks = runpy.run_path(str(ROOT / "scripts" / "mkdocs_hooks.py"))
    text = (ROOT / "docs" / "api.md").read_text()
    built = hooks["on_page_markdown"](text)
    named = re.findall(r"^<!-- api: (\S+)", text, re.M)
    assert "celery_emq" in named and "celery_emq.store.jobstore" in named
    assert re.findall(r"^::: (\S+)$", built, re.M) == named
    assert "<!-- api:" not in built
    # The options stay under their directive, as mkdocstrings reads them.
    assert "::: celery_emq\n    options:\n      members:\n        - Morgue\n" in built
    assert (ROOT / "mkdocs.yml").read_text().count("scripts/mkdocs_hooks.py") == 1


def test_the_marked_examples_are_there() -> None:
    shown = {m["path"] for page in PAGES for m in blocks(page.read_text())}
    assert {
        "examples/quickstart/app.py",
        "examples/beat_sweep/app.py",
        "examples/dead_letter_handler/app.py",
        "examples/testing/tasks.py",
        "examples/testing/test_tasks.py",
        "examples/testing/test_crash.py",
        "examples/batch_publish/app.py",
    } <= shown


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_block_is_its_example_file(page: Path) -> None:
    text = page.read_text()
    # Every marker heads a block (a marker the pattern cannot pair is a typo).
    assert text.count("<!-- example:") == len(blocks(text))
    for m in blocks(text):
        assert m["body"] == (ROOT / m["path"]).read_text(), (
            f"{page.name}: the block of {m['path']} differs from the file; "
            "run scripts/docs-examples"
        )


if __name__ == "__main__":
    for page in PAGES:
        if sync(page):
            print(f"updated {page.relative_to(ROOT)}")
