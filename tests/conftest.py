"""Session setup: without a ROCm GPU, FlyDSL kernels run under flyquant.emu.

The emulator must be enabled before FlyDSL's runtime library is first loaded (the first
launch), so it is done once, when pytest starts. Tests marked ``gpu`` (marker registered in
pyproject.toml) need a real MI300X/MI355X and are skipped here.
"""

import pytest

import flyquant.emu as emu

DEFAULT_EMU_ARCH = "gfx950"  # the default compile target; tests pick their arch with toolchain.target


def pytest_configure(config):
    if not emu.rocm_device_present() and not emu.enabled():
        emu.enable(DEFAULT_EMU_ARCH)


def pytest_collection_modifyitems(config, items):
    if emu.rocm_device_present():
        return
    skip_gpu = pytest.mark.skip(reason="needs a real MI300X/MI355X: no ROCm device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
