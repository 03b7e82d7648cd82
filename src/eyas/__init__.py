"""eyas: train EAGLE-3 drafts for any Hugging Face LLM and serve them in vLLM / SGLang.

Each pipeline step is a function taking one config dataclass, e.g.
`from eyas import prepare, PrepareConfig; prepare(PrepareConfig(target=..., data=..., out=...))`.
Names are imported lazily so `import eyas` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "prepare": "eyas.prepare", "PrepareConfig": "eyas.prepare",
    "doctor": "eyas.doctor", "DoctorConfig": "eyas.doctor",
    "convert": "eyas.convert", "ConvertConfig": "eyas.convert",
    "capture": "eyas.capture", "CaptureConfig": "eyas.capture",
    "vocab": "eyas.vocab", "VocabConfig": "eyas.vocab",
    "train": "eyas.train", "TrainConfig": "eyas.draft.train_config",
    "export": "eyas.export", "ExportConfig": "eyas.export",
    "evaluate": "eyas.evaluate", "EvalConfig": "eyas.evaluate",
    "regenerate": "eyas.regenerate", "RegenerateConfig": "eyas.regenerate",
    "run": "eyas.pipeline", "RunConfig": "eyas.pipeline",
    "demo": "eyas.demo", "DemoConfig": "eyas.demo",
    "Eagle3Draft": "eyas.draft.eagle3", "DraftConfig": "eyas.draft.eagle3",
    "inspect_model": "eyas.targets.models", "ModelInfo": "eyas.targets.models",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'eyas' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
