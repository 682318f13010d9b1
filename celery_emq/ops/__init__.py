"""Operations: the ``celery emq`` CLI, the beat task, metrics and the exporter,
Flower's pages, and migrating from ``redis://``. The top layer: it may use
every layer below it, and nothing below imports it.
"""
