"""A target checkpoint's tensors, one at a time: which safetensors file holds each tensor, the
checkpoint key of a module's weight (wrappers often rename the prefix), and reading one
tensor without loading the model. Offline training reads the embedding and lm_head so, and
the vLLM capture backend the final norm and lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.errors import EyasError

INDEX = "model.safetensors.index.json"


class TargetWeights:
    """The safetensors files of a local folder or hub repo (`name`), indexed by tensor name."""

    def __init__(self, name: str, revision: str | None = None):
        self.name = name
        self.where, self._fetch = _weight_map(name, revision)

    def key(self, name: str) -> str | None:
        """The checkpoint key of module weight `name`: itself, or else the unique key ending in
        its longest matching suffix of at least two parts (checkpoints of wrappers often add,
        drop or rename the prefix: Qwen2.5-VL stores model.language_model.embed_tokens as
        model.embed_tokens; Kimi-K2.5 stores the text model's lm_head.weight as
        language_model.lm_head.weight)."""
        if name in self.where:
            return name
        parts = name.split(".")
        for n in range(len(parts), 1, -1):  # the whole name first: a key that only adds a prefix
            suffix = ".".join(parts[-n:])
            hits = [k for k in self.where if k == suffix or k.endswith("." + suffix)]
            if len(hits) == 1:
                return hits[0]
        return None

    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under checkpoint key `key` (an owned copy)."""
        from safetensors import safe_open

        with safe_open(self._fetch(self.where[key]), framework="pt") as f:
            return f.get_tensor(key)


def _weight_map(name: str, revision: str | None):
    """(tensor name -> file name, fetch(file name) -> local path) for a folder or hub repo."""
    from safetensors import safe_open

    folder = Path(name).expanduser()
    if folder.is_dir():
        def fetch(file: str) -> str:
            return str(folder / file)
        if (folder / INDEX).is_file():
            return json.loads((folder / INDEX).read_text())["weight_map"], fetch
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    else:
        from huggingface_hub import hf_hub_download, list_repo_files

        def fetch(file: str) -> str:
            return hf_hub_download(name, file, revision=revision)
        listed = list_repo_files(name, revision=revision)
        if INDEX in listed:
            return json.loads(Path(fetch(INDEX)).read_text())["weight_map"], fetch
        files = sorted(f for f in listed if f.endswith(".safetensors") and "/" not in f)
    if not files:
        raise EyasError(f"{name} has no safetensors weights; convert them (save_pretrained with "
                        f"safe_serialization) or train with --online.")
    out = {}
    for file in files:
        with safe_open(fetch(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out, fetch
