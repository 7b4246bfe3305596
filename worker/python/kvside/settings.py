"""Typed settings from an engine's extra-config dict (the vLLM connector's
kv_connector_extra_config, the SGLang backend's extra config): each value
must have the type of its dataclass field's default."""


def assign(cfg, known, items):
    """Sets cfg.<name> = value for every (name, value) in items whose name is
    in known ({name: dataclasses.Field}); others are left to the caller.
    Raises ValueError naming the key when a value has the wrong type."""
    for k, v in items:
        if k not in known:
            continue
        default = known[k].default
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ValueError("kvside: %s must be true or false, not %r" % (k, v))
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError("kvside: %s must be a non-negative integer, not %r" % (k, v))
        elif v is not None and not isinstance(v, str):
            raise ValueError("kvside: %s must be a string, not %r" % (k, v))
        setattr(cfg, k, v)
