"""Moved to ``core.configlib``; kept so imports written before the move keep working."""

from core.configlib import *  # noqa: F401,F403
from core.configlib import apply_override, dump_toml, from_dict, load_toml, parse_value, to_dict  # noqa: F401
