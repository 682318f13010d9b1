"""The Celery integration: what runs inside a Celery worker.

The hooks into Celery's worker (the one place Celery's private names are
used, each checked at worker start) and the dead-letter follow-up (signal,
result, event). Installed through Celery's signals, not by the transport.
"""
