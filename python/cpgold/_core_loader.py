"""Loads cpgold's C++ core (the extension module cpgold._core) with a message that says how to get it."""

_core = None


def core():
    """The extension module; ImportError naming the two ways to build it when it is missing."""
    global _core
    if _core is None:
        try:
            from . import _core as module
        except ImportError as e:
            raise ImportError(
                "cpgold's C++ core (the extension cpgold._core) is not available: install the package with "
                "`pip install ./python` from the repository root (it builds the extension), or build the "
                "cpgold_python_core target of the CMake build and put build/python on PYTHONPATH next to python/ "
                f"({e})") from None
        _core = module
    return _core


def available():
    try:
        core()
        return True
    except ImportError:
        return False
