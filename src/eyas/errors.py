"""The one exception type steps raise for user-facing problems (bad input, mismatched
artifacts). The CLI prints its message without a traceback; the message says how to fix it."""


class EyasError(RuntimeError):
    pass


class LosslessError(EyasError):
    """`eyas eval`'s lossless check found a speculative output that differs from the target's
    greedy output beyond rounding. Exit code 3 (2 is a usage or input error), also from
    `eyas run`, so scripts can tell a wrong draft path from a wrong command."""

    exit_code = 3
