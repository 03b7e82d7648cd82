"""`python -m speculators` for a machine without an accelerator, for the CPU smoke test only.

speculators 0.9.0's Trainer assumes an accelerator: it moves the model and every batch to the
integer device `get_local_rank()` (0 = the current accelerator) and autocasts on "cuda" when no
accelerator is found. Here those two places point at the CPU instead (bf16 autocast on CPU);
nothing of the recipe changes. The H200 run does not use this file.
"""

import sys

import torch

from speculators.train import trainer

trainer.get_local_rank = lambda: "cpu"
_setup_trainer = trainer.Trainer.setup_trainer


def _setup_trainer_on_cpu(self):
    self.device_type = "cpu"
    return _setup_trainer(self)


trainer.Trainer.setup_trainer = _setup_trainer_on_cpu
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *a, **k: None

if __name__ == "__main__":
    from speculators.cli import app

    sys.argv[0] = "speculators"
    app()
