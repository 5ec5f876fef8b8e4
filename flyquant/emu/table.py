"""The instruction table: the isa_* modules register their builders here, the interpreter reads it.

A builder takes a decoded instruction and the build context and returns the instruction's
closure (or None: not supported). The interpreter looks an instruction up by its name first,
then by its encoding (memory instructions share one builder per encoding). Registering a name
or an encoding twice is an error at import, so two modules can never silently shadow each other.
"""

from __future__ import annotations

BY_NAME: dict = {}
BY_ENCODING: dict = {}


def _add(table: dict, builders: dict, what: str) -> None:
    clash = sorted(set(builders) & set(table))
    if clash:
        raise ValueError(f"instruction {what}s registered twice: {', '.join(clash)}")
    table.update(builders)


def register(builders: dict) -> None:
    """Add {instruction name: builder}."""
    _add(BY_NAME, builders, "name")


def register_encoding(builders: dict) -> None:
    """Add {encoding: builder} for the instructions of that encoding without a builder by name."""
    _add(BY_ENCODING, builders, "encoding")


def builder(inst):
    """The builder for `inst`, or None when no module registered one."""
    found = BY_NAME.get(inst.name)
    return found if found is not None else BY_ENCODING.get(inst.enc)
