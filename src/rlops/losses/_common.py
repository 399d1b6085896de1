"""Numbers shared by the loss modules (private to the package)."""

__all__ = ["MAX_EXP_ARG"]

MAX_EXP_ARG = 20.0
