"""User-facing errors raised by the model layer.

Every error a user can trigger with bad input (a broken checkpoint, an unknown layer type,
a prompt that does not fit) is a `HyraxInputError`: the CLI prints its message as one line
and exits non-zero instead of showing a traceback.
"""


class HyraxInputError(ValueError):
    """Bad input from a user: a clear one-line message, nothing changed."""


class StartupFailure(RuntimeError):
    """Something outside the user's input stopped a deployment from starting (a replica's
    actor died, a rank could not load); the message is one line for the CLI."""
