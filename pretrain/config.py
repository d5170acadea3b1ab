"""Moved to ``run.config``; kept so imports written before the move keep working."""

from run.config import *  # noqa: F401,F403
from run.config import RunConfig, load_run_config, model_config_from_dict, run_config_from_dict  # noqa: F401
