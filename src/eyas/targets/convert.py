"""De-quantize a GGUF target once into a Hugging Face folder (`eyas convert`).

A `.gguf` target costs its load at every run of every step: transformers parses the file's
metadata in pure Python (config, tokenizer, weights: the vocabulary is walked each time) and
de-quantizes every tensor. For SmolLM2-135M Q4_1 that was 34 s of a 4-prompt CPU eval against
8 s for the same weights in a folder (docs/benchmarks.md). `convert_gguf` pays it once and
writes what `save_pretrained` writes for any checkpoint: `model.safetensors` (the de-quantized
weights in `dtype`), `config.json` (no quantization config), `generation_config.json`, the
tokenizer files with the GGUF's chat template, and an `eyas.json` naming the GGUF (path, size,
`gguf_fingerprint`). `target_record` copies that identity into every manifest made with the
folder, so artifacts made from the GGUF and from its folder belong to one target, and a folder
converted from another GGUF is refused as that GGUF would be.

The folder is written beside `out` under a temporary name and renamed into place when complete:
a killed run leaves no `out` that looks finished (the next run clears the leftover), and an
existing `out` is kept unless it is this same conversion (then nothing is done).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from eyas.errors import EyasError
from eyas.store.manifest import (MANIFEST, gguf_fingerprint, read_manifest, target_record,
                                 write_manifest)
from eyas.store.permissions import as_umask
from eyas.targets.gguf import is_gguf
from eyas.targets.models import load_target, load_tokenizer

log = logging.getLogger(__name__)

# float32 holds every de-quantized GGUF value exactly (llama.cpp's blocks are fp16 scales
# times small ints); bfloat16 / float16 round them but halve the folder.
CONVERT_DTYPES = ("float32", "bfloat16", "float16")


def convert_gguf(gguf: str | Path, out: str | Path, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder `out` holding the GGUF file `gguf` de-quantized to `dtype`
    (one of CONVERT_DTYPES) and return its path. Does nothing if `out` already holds this
    conversion; refuses any other existing, non-empty `out`."""
    if dtype not in CONVERT_DTYPES:
        raise EyasError(f"dtype {dtype!r}: use one of {CONVERT_DTYPES}")
    gguf, out = Path(gguf).expanduser(), Path(out).expanduser().absolute()
    if not is_gguf(gguf):
        raise EyasError(f"{gguf} is not a .gguf file: only a GGUF target needs converting (a "
                        f"Hugging Face folder or hub name loads as it is)")
    if not gguf.is_file():
        raise EyasError(f"GGUF file {gguf} "
                        f"{'is a folder' if gguf.is_dir() else 'does not exist'}; pass the "
                        f"path of a local .gguf file")
    gguf = gguf.resolve()
    if _already_converted(out, gguf, dtype):
        return out
    start = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp-convert")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover
    tmp.mkdir(parents=True)
    try:
        _write(gguf, tmp, out, dtype)
        _put_in_place(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if "No space left on device" in str(err) and not isinstance(err, EyasError):
            # (safetensors' own error, not an OSError, says only this)
            raise EyasError(f"converting {gguf} into {out}: no space left on the device "
                            f"({str(err)[:200]}); free some space beside {out}, then run it "
                            f"again (convert does not resume)") from err
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    log.info("wrote %s (%s, %.2f GB) from %s in %.1f s", out, dtype, size / 1e9, gguf,
             time.perf_counter() - start)
    return out


def _put_in_place(tmp: Path, out: Path) -> None:
    """The finished conversion `tmp` becomes `out`: renamed (atomic) where `out` is missing
    or an empty folder, its files moved in where that folder cannot be replaced (a mount
    point: the rename failed after the whole conversion, which was thrown away)."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out.is_dir() and not any(out.iterdir())):
            raise
        for f in sorted(tmp.iterdir()):
            shutil.move(str(f), str(out / f.name))
        tmp.rmdir()


def _write(gguf: Path, folder: Path, out: Path, dtype: str) -> None:
    """The model, tokenizer and manifest of `gguf`, saved into the (empty) `folder` that will
    become `out`."""
    tokenizer = load_tokenizer(gguf)
    model, _ = load_target(gguf, dtype=dtype, device="cpu")
    # The weights are plain tensors now; transformers versions that keep GgufConfig's
    # quantizer on the model would refuse to save it, or write its quantization_config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)  # safetensors, config.json, generation_config.json
    with_legacy_rope(folder / "config.json")
    tokenizer.save_pretrained(folder)  # tokenizer files and the chat template
    as_umask(folder)  # safetensors writes owner-only: a vLLM server may run as another user
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
    write_manifest(folder, "convert", {"target": str(gguf), "out": str(out), "dtype": dtype},
                   target=target_record(str(gguf), config=model.config, tokenizer=tokenizer),
                   dtype=dtype, files=files)


def with_legacy_rope(config_json: Path) -> None:
    """Add the RoPE keys of transformers 4 (`rope_theta`, and `rope_scaling` for a scaled
    RoPE) beside the `rope_parameters` that transformers 5 writes alone. A reader on
    transformers 4 (an older vLLM or SGLang serving the folder) ignores `rope_parameters` and
    would run RoPE at its default base, 10,000: SmolLM2's is 100,000, Qwen2.5's 1,000,000.
    transformers 5 reads both and keeps `rope_parameters`. M-RoPE's `mrope_section` goes into
    `rope_scaling` too. Per-layer-type parameters (no
    single `rope_theta`) have no transformers 4 form and are left as they are."""
    body = json.loads(config_json.read_text())
    params = body.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return
    body.setdefault("rope_theta", params["rope_theta"])
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    # a scaled RoPE, or a plain one with more to say (M-RoPE's `mrope_section`, which a
    # transformers 4 reader finds only in `rope_scaling`)
    if scaling.get("rope_type", "default") != "default" or set(scaling) - {"rope_type"}:
        body.setdefault("rope_scaling", scaling)
    tmp = config_json.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, config_json)


def _already_converted(out: Path, gguf: Path, dtype: str) -> bool:
    """True if `out` holds this conversion; False if it is missing or empty; EyasError else."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise EyasError(f"{out} exists and is a file; choose a new --out folder")
    if not any(out.iterdir()):
        return False
    body = _manifest(out) if (out / MANIFEST).is_file() else {}
    if body.get("step") != "convert":
        raise EyasError(f"{out} exists and is not an `eyas convert` folder; choose a new or "
                        f"empty --out (eyas convert never overwrites a folder)")
    had = _recorded(out, body)
    if had["gguf_fingerprint"] == gguf_fingerprint(gguf) and body["dtype"] == dtype:
        files = body.get("files") or {}
        broken = [f for f, size in files.items()
                  if not (out / f).is_file() or (out / f).stat().st_size != size]
        if broken:
            raise EyasError(f"{out} holds this conversion, but {', '.join(sorted(broken))} "
                            f"{'is' if len(broken) == 1 else 'are'} missing or of another size "
                            f"than written; delete {out} and convert again")
        log.info("%s already holds %s de-quantized to %s; nothing to do", out, gguf.name, dtype)
        return True
    raise EyasError(f"{out} already holds another conversion: {had['name_or_path']} "
                    f"(gguf_fingerprint {had['gguf_fingerprint']}) in {body['dtype']}, not "
                    f"{gguf} in {dtype}; choose another --out, or delete {out} to convert again")


def _manifest(out: Path) -> dict:
    """The body of `out`'s eyas.json (store.manifest.read_manifest); EyasError if it is not a
    JSON object, saying what convert needs."""
    try:
        return read_manifest(out)
    except (OSError, EyasError):  # not JSON, not UTF-8, not an object
        raise EyasError(f"{out / MANIFEST} is unreadable (not a JSON object); move {out} away "
                        f"or pass another --out") from None


def _recorded(out: Path, body: dict) -> dict:
    """The GGUF record of the convert manifest `body`, checked for every key read from it: a
    hand-edited or damaged manifest is refused here, naming the keys, not with a KeyError."""
    had = body["target"] if isinstance(body.get("target"), dict) else {}
    bad = [f"target.{k}" for k in ("gguf_fingerprint", "name_or_path") if k not in had]
    bad += [k for k in ("dtype",) if not isinstance(body.get(k), str)]
    bad += [k for k in ("files",) if not isinstance(body.get(k) or {}, dict)]
    if bad:
        raise EyasError(f"{out / MANIFEST} is a damaged `eyas convert` manifest ({', '.join(bad)} "
                        f"{'is' if len(bad) == 1 else 'are'} missing or malformed), so what {out} "
                        f"holds is unknown; move {out} away or pass another --out, and convert "
                        f"again")
    return had
