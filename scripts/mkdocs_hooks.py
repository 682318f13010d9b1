"""mkdocs hooks (``hooks:`` in mkdocs.yml): the API page reads right on GitHub too.

The API page names each module it documents in an HTML comment, which GitHub
hides::

    <!-- api: celery_emq.transport.sweeper
        options:
          members:
            - Sweeper
    -->

Before the site renders the page, each comment becomes the mkdocstrings
directive it holds (``::: celery_emq.transport.sweeper`` and its options).
A bare ``:::`` line would show on GitHub as a paragraph of raw text.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- api: (?P<name>\S+)(?P<options>.*?)-->$", re.M | re.S)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Turn each ``<!-- api: module ... -->`` comment into ``::: module`` and its options."""
    return MARKER.sub(lambda m: f"::: {m['name']}{m['options'].rstrip()}", markdown)
