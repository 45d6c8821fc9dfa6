"""The class of errors every rank raises alike, at the same point, with one message that says what happened and
what to do (the ranks agreed through a collective, or read the same values): run_rank (entry.py) prints it once,
by rank 0, as one line, and ends the rank with status 2, where a traceback per rank would bury the message."""


class AgreedError(RuntimeError):
    """An error every rank raises alike; its message is the whole report."""
