"""Moved to ``core.files``; kept so imports written before the move keep working."""

from core.files import atomic_write_text, fsync_dir  # noqa: F401
