"""The one exception type users see: a one-line message that names the problem and the fix."""


class LyannaError(Exception):
    """A user-facing error; the CLI prints its message on one line and exits non-zero."""
