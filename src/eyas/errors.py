"""The one exception type steps raise for user-facing problems (bad input, mismatched
artifacts). The CLI prints its message without a traceback; the message says how to fix it."""


class EyasError(RuntimeError):
    pass
