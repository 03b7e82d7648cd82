"""A draft vocabulary folder (written by `eyas vocab`): d2t / t2d, checked and read.
"""

from __future__ import annotations
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
import torch

from eyas.store.manifest import MANIFEST, read_manifest
from eyas.errors import EyasError


VOCAB_FILE = "vocab.safetensors"


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int | None = None,
                draft_vocab_size: int | None = None,
                fix: str = "use the same --draft-vocab-size for vocab and train") -> None:
    """Refuse a d2t/t2d pair that is malformed or made for other vocab sizes (`fix`: what to do
    where d2t is not `draft_vocab_size` long)."""
    if d2t.dim() != 1 or t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise EyasError(f"vocab: d2t must be 1-D int64 and t2d 1-D bool, got d2t "
                        f"{tuple(d2t.shape)} {d2t.dtype}, t2d {tuple(t2d.shape)} {t2d.dtype}")
    if vocab_size is not None and t2d.numel() != vocab_size:
        raise EyasError(f"vocab: t2d covers {t2d.numel()} target ids but the target has "
                        f"{vocab_size}; re-run `eyas vocab` on data prepared for this target")
    if draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
        raise EyasError(f"vocab: d2t has {d2t.numel()} draft ids but the draft expects "
                        f"{draft_vocab_size}; {fix}")
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if int(t2d.sum()) != d2t.numel() or not torch.equal(ids.cpu(), t2d.nonzero().squeeze(1).cpu()):
        raise EyasError("vocab: d2t and t2d disagree (target ids i + d2t[i] must be exactly the "
                        "true entries of t2d, ascending); re-run `eyas vocab`")


def read_tensors(path: Path, keys: tuple[str, ...], fix: str) -> dict[str, torch.Tensor]:
    """The safetensors file `path`, holding at least `keys`; missing, unreadable (cut short,
    another format) or without one of them is an EyasError naming the file and `fix`."""
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise EyasError(f"{path} is missing; {fix}") from None
    except (SafetensorError, OSError) as err:
        raise EyasError(f"{path} is not a readable safetensors file ({err}); {fix}") from None
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise EyasError(f"{path} holds no {missing} (it has {sorted(tensors)}); {fix}")
    return tensors


def load_vocab(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(d2t, t2d, manifest) of a folder written by `eyas vocab`, checked."""
    manifest = read_manifest(folder, step="vocab")
    data = ",".join((manifest.get("config") or {}).get("data") or ["PREPARED"])
    again = f"make it again: eyas vocab --data {data} --out {folder}"
    if manifest.get("complete") is False:
        raise EyasError(f"{folder} holds an `eyas vocab` run that was stopped before it "
                        f"finished; {again}")
    tensors = read_tensors(Path(folder) / VOCAB_FILE, ("d2t", "t2d"), again)
    check_vocab(tensors["d2t"], tensors["t2d"], manifest.get("vocab_size"),
                manifest.get("draft_vocab_size"),
                fix=f"its {VOCAB_FILE} is not the one its {MANIFEST} records (an `eyas vocab` "
                    f"into it stopped between the two?): {again}")
    return tensors["d2t"], tensors["t2d"], manifest
