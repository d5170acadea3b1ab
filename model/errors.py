"""The one error type for bad user input, shared by every package.

A ConfigError's message is a single line that names the offending field
(``data.path``, ``model.n_heads`` ...) and says what is allowed; the CLIs
print it without a traceback and exit with status 2.
"""


class ConfigError(ValueError):
    """Invalid configuration or input, detected before any work starts."""
