"""The one exception type steps raise for user-facing problems (bad input, mismatched
artifacts). The CLI prints its message without a traceback; the message says how to fix it."""


class EyasError(RuntimeError):
    """`flag`: the option whose value is refused (`--out`, `--resume`), where the fix is to
    change it. `eyas run` sets some options itself, so it adds where it put them."""

    def __init__(self, message: str = "", *, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


class LosslessError(EyasError):
    """`eyas eval`'s lossless check found a speculative output that differs from the target's
    greedy output beyond rounding. Exit code 3 (2 is a usage or input error), also from
    `eyas run`, so scripts can tell a wrong draft path from a wrong command."""

    exit_code = 3
