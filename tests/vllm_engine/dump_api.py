"""Prints the public API of the installed vLLM's KVConnectorBase_V1 and
SupportsHMA in the form of tests/vllm/vllm_api.txt (the list the stand-in's
base classes and the connector are checked against by tests/vllm). After a
vLLM upgrade: dump_api.py > tests/vllm/vllm_api.txt, then bring the stand-in
(tests/vllm/stub) to the new list; test_units.py fails until the file is the
installed release's."""

import inspect
import sys


def params(fn):
    return [("**" if p.kind == p.VAR_KEYWORD else "*" if p.kind == p.VAR_POSITIONAL else "") + p.name
            for p in inspect.signature(fn).parameters.values()]


def lines():
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    out = ["# vllm %s vllm/distributed/kv_transfer/kv_connector/v1/base.py (tests/vllm_engine/dump_api.py)"
           % vllm.__version__,
           "# One line per public method/property; parameter names as in vLLM (defaults omitted).",
           "# Private helpers (names starting with _) omitted."]
    for cls in (base.SupportsHMA, base.KVConnectorBase_V1):
        abstract = getattr(cls, "__abstractmethods__", frozenset())
        for name, raw in cls.__dict__.items():
            if name.startswith("_") and name != "__init__":
                continue
            deco = "@abstractmethod " if name in abstract else ""
            if isinstance(raw, property):
                out.append("%s@property %s.%s(%s)" % (deco, cls.__name__, name, ", ".join(params(raw.fget))))
            elif isinstance(raw, classmethod):
                p = ["cls"] + params(raw.__func__)[1:]
                out.append("%s@classmethod %s.%s(%s)" % (deco, cls.__name__, name, ", ".join(p)))
            elif inspect.isfunction(raw):
                out.append("%s%s.%s(%s)" % (deco, cls.__name__, name, ", ".join(params(raw))))
    return out


if __name__ == "__main__":
    sys.stdout.write("\n".join(lines()) + "\n")
