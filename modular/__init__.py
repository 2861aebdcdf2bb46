"""modular: make behaviours of language models modular.

A behaviour is fine-tuned to live in one designated direction of the residual
stream: project the direction out and the behaviour is locked, add it back and
it is unlocked.
"""

__version__ = "0.1.0"


class ModularError(Exception):
    """An error caused by the user's input (bad model reference, malformed data, wrong key, ...).

    Command-line entry points print it as one line and exit with status 2.
    """


def error_reason(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): why a file could not be read,
    in a :class:`ModularError`'s one line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
