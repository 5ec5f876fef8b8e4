"""The emulator's error type, in a module of its own so that every part of flyquant.emu (the
HIP stand-in, the interpreter, the instruction modules) can raise it without importing another."""

from __future__ import annotations


class EmuError(RuntimeError):
    """flyquant.emu cannot do something: set itself up (no C compiler, FlyDSL already bound to a
    real HIP, ...) or execute a kernel (an unknown or wrong-arch instruction, an unsupported
    feature, a wave that never ends; then the message names the instruction, offset and kernel)."""
