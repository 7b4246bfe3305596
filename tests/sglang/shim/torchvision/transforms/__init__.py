"""torchvision.transforms names SGLang imports at module level (see ../__init__.py)."""
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


from . import functional  # noqa: E402,F401


def __getattr__(name):
    raise AttributeError("torchvision stand-in (tests/sglang/shim): transforms.%s is not available" % name)
