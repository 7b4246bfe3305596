"""Mirrors vllm/logger.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
``init_logger(name)`` returns a standard logger under the "vllm" hierarchy,
with the ``*_once`` helpers vLLM's logger class adds."""

import logging

_seen = set()


class _Logger(logging.Logger):
    def _once(self, level, msg, *args):
        key = (level, msg, args)
        if key not in _seen:
            _seen.add(key)
            self.log(level, msg, *args)

    def info_once(self, msg, *args, **kw):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **kw):
        self._once(logging.WARNING, msg, *args)

    def debug_once(self, msg, *args, **kw):
        self._once(logging.DEBUG, msg, *args)


def init_logger(name):
    cls = logging.getLoggerClass()
    logging.setLoggerClass(_Logger)
    try:
        return logging.getLogger(name)
    finally:
        logging.setLoggerClass(cls)
