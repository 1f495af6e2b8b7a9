"""The one error the serving package raises on purpose: its message says what failed and why."""

__all__ = ["ServerError"]


class ServerError(RuntimeError):
    """A server did not start, did not answer, or left processes behind; the message says which."""
