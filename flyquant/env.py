"""flyquant's environment variables: the one table of them, and readers that check a value
when it is read.

Every ``FLYQUANT_*`` variable is read through this module. A value that does not parse is an
``EnvError`` (a ValueError) naming the variable, the bad value and the form expected; an unset
or empty variable means its default. A ``FLYQUANT_*`` variable that is not in the table
(usually a misspelling) is reported once per process with a RuntimeWarning listing the known
ones, by ``warn_unknown`` (the selector calls it).
"""

from __future__ import annotations

import os
import warnings

VARIABLES = {
    "FLYQUANT_BACKEND": "auto|reference|flydsl: where calls run (flyquant.select)",
    "FLYQUANT_ARCH": "gfx942|gfx950: the arch kernels are compiled for",
    "FLYQUANT_CONFIG": 'a JSON object of MoE configuration fields, e.g. {"tile_n": 128, "waves": 2}',
    "FLYQUANT_TUNING": "an absolute path: a JSON tuning table written by bench/moe_tile_n.py",
    "FLYQUANT_EMU": "gfx942|gfx950: enable flyquant.emu when it is imported",
    "FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS": "a positive integer: instructions after which a wave is taken to never end",
    "FLYQUANT_CACHE_DIR": "an absolute path: flyquant's cache, a directory owned by you and writable only by you",
    "FLYQUANT_DEBUG": "0|1: extra checks that need a host synchronisation",
}


class EnvError(ValueError):
    """A FLYQUANT_* variable (or the file it names) holds a value flyquant cannot use."""


def error(name: str, value, expected: str) -> EnvError:
    """The error for `name`=`value`: what it must be instead."""
    return EnvError(f"{name}={value!r}: expected {expected}")


def raw(name: str) -> str | None:
    """The variable's value with surrounding whitespace removed; None when unset or empty."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a flyquant environment variable (known: {', '.join(VARIABLES)})")
    value = os.environ.get(name, "").strip()
    return value or None


def choice(name: str, choices, default: str | None = None) -> str | None:
    """One of `choices` (compared in lower case), or `default` when unset."""
    value = raw(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise error(name, value, f"one of {'|'.join(choices)}")
    return value.lower()


def positive_int(name: str, default: int) -> int:
    """A positive integer in ASCII decimal digits, or `default` when unset (int() alone would also
    take "+5", "5_000" and non-ASCII digits)."""
    value = raw(name)
    if value is None:
        return default
    number = int(value) if value.isascii() and value.isdigit() else 0
    if number <= 0:
        raise error(name, value, "a positive integer")
    return number


def flag(name: str) -> bool:
    """0 or 1 (unset: 0)."""
    return choice(name, ("0", "1"), "0") == "1"


def absolute_path(name: str) -> str | None:
    """An absolute path (``~`` expanded), or None when unset. Relative paths are refused: they
    would name a different directory in every working directory."""
    value = raw(name)
    if value is None:
        return None
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise error(name, value, f"an absolute path ({VARIABLES[name].split(': ', 1)[-1]})")
    return path


_warned: set[str] = set()


def unknown() -> list[str]:
    """FLYQUANT_* variables set in the environment that flyquant does not read."""
    return sorted(n for n in os.environ if n.startswith("FLYQUANT_") and n not in VARIABLES)


def warn_unknown() -> None:
    """Warn once per process about each unknown FLYQUANT_* variable (most likely misspelt)."""
    new = [n for n in unknown() if n not in _warned]
    if new:
        _warned.update(new)
        warnings.warn(
            f"unknown flyquant environment variable(s) {', '.join(new)} ignored; known: {', '.join(VARIABLES)}",
            RuntimeWarning,
            stacklevel=3,
        )


__all__ = ["VARIABLES", "EnvError", "absolute_path", "choice", "error", "flag", "positive_int", "raw", "unknown", "warn_unknown"]
