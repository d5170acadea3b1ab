"""Moved to ``core.errors``; kept so imports written before the move keep working."""

from core.errors import ConfigError, check_choice, check_min, check_range  # noqa: F401
