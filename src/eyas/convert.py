"""`eyas convert`: a `.gguf` target de-quantized once into a Hugging Face folder.

Every step then takes `--target FOLDER` instead of `--target model.gguf` and skips the GGUF's
parse and de-quantization at each load; artifacts made with either belong to the same target
(the folder's `eyas.json` carries the GGUF's fingerprint). The work is
`eyas.targets.convert.convert_gguf`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eyas.config import ConfigError, check_choices, option, out_option, required
from eyas.store.manifest import MANIFEST, check_out
from eyas.targets.convert import CONVERT_DTYPES, convert_gguf
from eyas.targets.gguf import is_gguf


@dataclass(frozen=True)
class ConvertConfig:
    """Which GGUF file to de-quantize, where to, in which dtype."""

    target: str = required("the .gguf file to convert")
    out: str = out_option("the Hugging Face folder to write (must not exist, be empty, or hold "
                          "this same conversion: then nothing is done)")
    dtype: str = option("float32", "dtype of the written weights: float32 holds the "
                        "de-quantized values exactly; bfloat16 / float16 halve the folder",
                        choices=CONVERT_DTYPES)

    def __post_init__(self):
        check_choices(self)
        if not is_gguf(self.target):
            raise ConfigError(f"--target {self.target} is not a .gguf file: only a GGUF target "
                              f"needs converting (a Hugging Face folder or hub name loads as "
                              f"it is)")


def convert(cfg: ConvertConfig) -> Path:
    """Write the folder `cfg.out` from the GGUF file `cfg.target` and return its path (nothing
    is done if it already holds this conversion)."""
    check_out(cfg.out, "convert", own=_written(Path(cfg.out)))
    return convert_gguf(cfg.target, cfg.out, dtype=cfg.dtype)


def _written(out: Path) -> tuple[str, ...]:
    """The files an earlier conversion in `out` wrote (its manifest's `files`), if any."""
    try:
        return tuple(json.loads((out / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return ()
