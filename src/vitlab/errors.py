"""The exception for failures a user can fix; the CLI prints it as one line and exits non-zero."""


class VitlabError(Exception):
    """A user-facing error whose message names the cause and the fix."""
