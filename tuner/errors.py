"""The one exception type users see: a clear message, no traceback, exit code 2."""


class UserError(Exception):
    """Bad input (shape, space.yaml, template, storage, file): the message says what and where."""
