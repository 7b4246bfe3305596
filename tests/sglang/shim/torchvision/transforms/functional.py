"""torchvision.transforms.functional (see ../__init__.py)."""
from . import InterpolationMode  # noqa: F401


def __getattr__(name):
    raise AttributeError("torchvision stand-in (tests/sglang/shim): transforms.functional.%s is not available" % name)
