"""A target given as a `.gguf` file: its checks before transformers reads it, and one parse of
its metadata per process.

transformers reads a GGUF's config, tokenizer (with its chat template) and de-quantized weights
through the `gguf` package (eyas.targets.models loads them). What this module adds: a file that
is missing, not a GGUF, metadata only or cut short is refused with what to do, and the slow
metadata parse is done once per process for config and tokenizer alike.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import re
import struct
from pathlib import Path
from typing import Any

from eyas.errors import EyasError


def is_gguf(name_or_path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def check_gguf_file(name: str) -> tuple[str, dict]:
    """(the file's folder, `{"gguf_file": path}`) for `from_pretrained`, both absolute (so a
    same-named file in the working directory is never picked instead); EyasError for a file
    that cannot be a model's GGUF."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise EyasError(f"GGUF file {name} does not exist; pass the path of a local .gguf file "
                        f"(a GGUF on the hub: `hf download REPO FILE.gguf "
                        f"--local-dir DIR`, then --target DIR/FILE.gguf)")
    with open(path, "rb") as f:
        head = f.read(24)  # magic, version (u32), tensor count, metadata count (u64 each)
    if head[:4] != b"GGUF":
        raise EyasError(f"{name} is not a GGUF file (it does not start with the bytes 'GGUF'); "
                        f"download it again, or pass the model's Hugging Face folder instead")
    if importlib.util.find_spec("gguf") is None:
        raise EyasError(f"reading the GGUF file {name} needs the gguf package: pip install "
                        f"gguf, or pip install 'eyas[gguf]'")
    split = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", path.name, re.IGNORECASE)
    if split and int(split[2]) > 1:
        # transformers reads the one file: the other parts' layers would be initialized at
        # random, differently at every load, with the manifests' fingerprint (of this part)
        # the same
        first = path.name[:split.start()] + f"-00001-of-{split[2]}.gguf"
        raise EyasError(f"{name} is part {int(split[1])} of {int(split[2])} of a split GGUF "
                        f"(llama.cpp's gguf-split); transformers loads one file, so the other "
                        f"parts' weights would be random. Merge them first: `llama-gguf-split "
                        f"--merge {path.parent / first} merged.gguf`, then --target merged.gguf")
    if len(head) == 24 and int.from_bytes(head[8:16], "little") == 0:
        # transformers would build the architecture's default config (Llama: 7B) and
        # initialize every weight at random
        raise EyasError(f"{name} is a GGUF file without tensors (metadata only, such as "
                        f"llama.cpp's vocabulary files ggml-vocab-*.gguf), not a model; pass "
                        f"the .gguf file that holds the model's weights")
    return str(path.parent.resolve()), {"gguf_file": str(path.resolve())}


def gguf_damage(name: str) -> str:
    """Why the reference `gguf` reader fails on the GGUF file `name` ("" if it reads it): a file
    cut short fails there too (with numpy's or struct's error, wherever the cut falls), while
    one transformers does not support is read."""
    import gguf

    try:
        gguf.GGUFReader(Path(name).expanduser())
    except (ValueError, IndexError, OverflowError, struct.error) as err:
        return str(err).splitlines()[0] if str(err) else repr(err)
    return ""


# A GGUF file's metadata is parsed again at every from_pretrained (for SmolLM2-135M, ~5 s of
# pure Python on a CPU core; ~11 s for Qwen2.5-Coder's 151,936 tokens), and a step asks for
# config and tokenizer several times (its own use, the manifest record): load each once per
# process and hand out copies, keyed by the file's path, size and modification time. The
# parse itself is shared too: AutoConfig and AutoTokenizer each call transformers'
# load_gguf_checkpoint for the same metadata (the tokenizer once more for its config), so
# the first parse is kept and handed to the later ones (_parsed_once).
_LOADED: dict[tuple, Any] = {}
_PARSED: dict[tuple, dict] = {}


def load_once(kind: str, gguf_file: str, load, *key_extra):
    """`load()` (transformers' from_pretrained of the config or tokenizer of `gguf_file`) once
    per process for the same file, kind and `key_extra`; every caller gets its own copy."""
    stat = Path(gguf_file).stat()
    file_key = (gguf_file, stat.st_size, stat.st_mtime_ns)
    key = (kind, *file_key, *key_extra)
    if key not in _LOADED:
        with _parsed_once(file_key):
            _LOADED[key] = load()
    return copy.deepcopy(_LOADED[key])


@contextlib.contextmanager
def _parsed_once(file_key: tuple):
    """While loading from the GGUF file of `file_key` (its resolved path, size and modification
    time): transformers' metadata-only `load_gguf_checkpoint` (return_tensors=False) of that
    file parses it once per process and returns copies; any other call (tensors, another
    file) goes through unchanged. Without that function (another transformers), nothing
    changes."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse = getattr(gguf_utils, "load_gguf_checkpoint", None)
    if parse is None:
        yield
        return

    def parsed_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs or str(Path(path).resolve()) != file_key[0]:
            return parse(path, return_tensors, *args, **kwargs)
        if file_key not in _PARSED:
            _PARSED[file_key] = parse(path, return_tensors=False)
        return copy.deepcopy(_PARSED[file_key])

    gguf_utils.load_gguf_checkpoint = parsed_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = parse
