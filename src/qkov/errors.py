"""The one exception type for user mistakes (bad input, bad files, bad options).

The CLI turns a :class:`QkovError` into a one-line message and exit status 2;
anything else is a bug and keeps its traceback.
"""


class QkovError(Exception):
    """A problem with the user's input: a bad path, file, option or shape."""
