"""Platform tag for the kvside wheel (metadata is in pyproject.toml).

The wheel holds a native library (kvside/_lib/libkvside.so.0) loaded through
ctypes, so it is tagged for the build platform (py3-none-linux_<arch>) rather
than as pure Python; the library uses no Python C API, hence py3-none.
"""

import os

from setuptools import Distribution, setup
from wheel.bdist_wheel import bdist_wheel

LIB = os.path.join("kvside", "_lib", "libkvside.so.0")


class BinaryDistribution(Distribution):
    """Not pure: the files go to platlib, at the wheel's root."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


if not os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), LIB)):
    raise SystemExit("%s is missing: build the wheel with tools/build-wheel.sh" % LIB)

setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
