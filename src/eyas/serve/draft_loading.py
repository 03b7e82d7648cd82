"""The draft `eyas eval --draft` measures: an `eyas export` folder, a training run or one of its
checkpoints, EAGLE-3 or DFlash, loaded on the target's embedding (and, for DFlash, its lm_head)
after its manifest is checked against the target's; which checkpoint that is
(`measured_checkpoint`, what `eyas export --acceptance-report` compares); and the shape check
against the loaded target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eyas.dflash.model import DFlashDraft
from eyas.errors import EyasError
from eyas.store.manifest import MANIFEST, check_same_target, peek_manifest, read_manifest

log = logging.getLogger(__name__)


def load_draft(folder: str | Path, embedding: torch.nn.Module,
               lm_head: torch.nn.Module | None = None, target: dict | None = None, *,
               weights: bool = True):
    """An `eyas export` folder (config.json + safetensors, any export format; EAGLE-3 or
    DFlash), a training step folder or a run folder (its best, else last, checkpoint), on the
    embedding's device and dtype. A DFlash draft reads the target's `lm_head` too. `target`:
    the target's manifest record; a draft whose manifest names another target (with
    `weights`, also one of the same shape with other weights) is refused, naming it, before
    it is built. Returns (draft, manifest of the export or run folder, or
    None)."""
    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.dflash.formats import dflash_checkpoint_config, is_dflash_folder
    from eyas.draft.formats import PICK_ANOTHER, load_checkpoint, read_json, read_weights

    folder = Path(folder)
    step, manifest_dir = _draft_source(folder)
    manifest = None
    if manifest_dir is not None and (Path(manifest_dir) / MANIFEST).is_file():
        manifest = read_manifest(manifest_dir)
        check_same_target(manifest.get("target"), target, f"draft {folder}", weights=weights)
    if step is None:
        try:
            draft = (DFlashDraft.from_pretrained(folder, embedding.weight,
                                                 _head(lm_head, folder))
                     if is_dflash_folder(folder) else
                     Eagle3Draft.from_pretrained(folder, embed_tokens=embedding))
        except RuntimeError as err:  # torch's load_state_dict: shapes or keys that differ
            if "state_dict" not in str(err):
                raise
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            raise EyasError(f"draft {folder}: its weights do not fit its config.json "
                            f"({'; '.join(lines[1:3])[:300]}): the folder holds one draft's "
                            f"weights beside another's config (edited, or files copied in); "
                            f"export it again from its training run") from None
    else:
        dflash = dflash_checkpoint_config(read_json(step / "draft_config.json", PICK_ANOTHER))
        if dflash is not None:
            draft = DFlashDraft(dflash)
            draft.load_state_dict(read_weights(step / "draft.safetensors", PICK_ANOTHER))
            draft.set_target(embedding.weight, _head(lm_head, folder))
        else:
            dcfg, state = load_checkpoint(step)
            draft = Eagle3Draft(dcfg, embedding)
            draft.load_state_dict(state)
    w = embedding.weight
    return draft.to(device=w.device, dtype=w.dtype).eval(), manifest


def check_draft_target(folder: str | Path, target: dict, *, weights: bool = True) -> None:
    """Refuse a --draft made for another target, as load_draft does, from its manifest alone:
    before a large target is loaded (minutes, for a 70B) only to find the draft is not its."""
    _, manifest_dir = _draft_source(Path(folder))
    manifest = peek_manifest(manifest_dir) if manifest_dir is not None else None
    if manifest is not None:
        check_same_target(manifest.get("target"), target, f"draft {folder}", weights=weights)


def _draft_source(folder: Path) -> tuple[Path | None, Path | None]:
    """(the training checkpoint a --draft folder is or picks, None for an export folder; the
    folder whose eyas.json describes the draft, or None)."""
    from eyas.draft.formats import find_checkpoint

    if not folder.exists():
        raise EyasError(f"--draft {folder} does not exist; give an `eyas export` folder or an "
                        f"`eyas train` run or checkpoint folder")
    if (folder / "config.json").is_file():
        return None, folder
    if (folder / "draft.safetensors").is_file() or (folder / "checkpoints").is_dir():
        pick = f"--draft {folder / 'checkpoints'}/step-N"
        if (folder / "draft.safetensors").is_file() or (folder / "checkpoints/best").is_file():
            return find_checkpoint(folder, "best", pick)  # (a best that is gone: refused)
        # a run without eval during training has no best: its last step
        step, run = find_checkpoint(folder, "last", pick)
        log.info("--draft %s has no best checkpoint (no eval ran during training): measuring "
                 "its last, %s", folder, step.name)
        return step, run
    raise EyasError(f"{folder} is not a draft: expected an `eyas export` folder "
                    f"(config.json + model.safetensors) or an `eyas train` run or "
                    f"checkpoint folder")


def measured_checkpoint(folder: str | Path) -> str | None:
    """The training checkpoint (its step-N folder) an eval of --draft `folder` measures: the
    step folder itself, a run's best (else last), or the checkpoint an export recorded (None
    for a folder eyas did not export). `eyas export --acceptance-report` compares it."""
    step, _ = _draft_source(Path(folder))
    if step is not None:
        return str(step.resolve())
    return (peek_manifest(folder) or {}).get("checkpoint")


def _head(lm_head: torch.nn.Module | None, folder) -> torch.Tensor:
    if lm_head is None:
        raise EyasError(f"{folder} is a DFlash draft: it needs the target's lm_head, and this "
                        f"target has no output head eyas can find; evaluate it with the "
                        f"causal-LM target it was trained for (eyas doctor TARGET shows the "
                        f"head it finds)")
    return lm_head.weight


def check_draft(draft, info, folder: str) -> None:
    """Refuse a draft built for a target of another vocabulary or hidden size than `info`'s."""
    c = draft.cfg
    width = c.hidden_size if isinstance(draft, DFlashDraft) else c.target_hidden_size
    if c.vocab_size != info.vocab_size or width != info.hidden_size:
        raise EyasError(f"draft {folder} expects a target with vocab_size {c.vocab_size} and "
                        f"hidden_size {width}, but {info.architecture} has "
                        f"{info.vocab_size} and {info.hidden_size}; evaluate it with the "
                        f"target it was trained for")
