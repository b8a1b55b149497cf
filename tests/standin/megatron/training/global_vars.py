"""Global args and timers (stand-in; Megatron-LM keeps the args in `_GLOBAL_ARGS` too)."""

_GLOBAL_ARGS = None
_GLOBAL_TIMERS = None


class _Timer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class _Timers:
    def __call__(self, name, log_level=None):
        return _Timer()


def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized"
    return _GLOBAL_ARGS


def get_timers():
    return _GLOBAL_TIMERS


def set_global_variables(args, build_tokenizer=True):
    global _GLOBAL_ARGS, _GLOBAL_TIMERS
    assert _GLOBAL_ARGS is None, "args is already initialized"
    _GLOBAL_ARGS = args
    _GLOBAL_TIMERS = _Timers()
