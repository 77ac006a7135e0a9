"""Errors of the cpgold package."""


class InputError(ValueError):
    """Unusable input: a bad case, a file that is not what it should be, tensors of the wrong shape or name.
    `field` names what is wrong (a case key, "file:/dataset", an argument); the message says what was expected and
    what was found. The `cpgold` command exits 2 on the same errors."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


class CheckInputError(InputError, RuntimeError):
    """A check refused its input (the command's exit 2): the message is cpgold's error text."""
