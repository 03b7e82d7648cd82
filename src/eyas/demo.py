"""`eyas demo`: the real pipeline end to end on CPU, with no downloads.

1. Write a synthetic chat corpus (eyas.targets.corpus) and train a small Llama target on it for a
   few minutes, so the target has real structure for a draft to learn.
2. Write a pipeline YAML for that target and run it with `eyas run`:
   prepare -> capture -> vocab -> train -> export -> eval.
3. Print the acceptance report (AL by k, vs n-gram and vs no speculation).
Every part is deterministic given the seed; re-running resumes / skips finished work.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from eyas.store.permissions import as_umask
from eyas.config import option
from eyas.errors import EyasError
from eyas.targets.corpus import synthetic_chats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """Run the whole pipeline on a built-in tiny target."""

    out: str = option("demo-out", "work folder for the demo")
    fast: bool = option(False, "a smaller, quicker version of the same path (for CI)")
    seed: int = option(0, "random seed for corpus, target and draft")


# The demo's sizes: (conversations, target hidden, target layers, target train steps,
#                    draft train steps, eval prompts, new tokens per prompt)
SIZES = {
    False: dict(chats=2000, hidden=96, layers=8, target_steps=400, draft_steps=200,
                prompts=20, new_tokens=48, batch_tokens=2048),
    True: dict(chats=600, hidden=64, layers=8, target_steps=150, draft_steps=60,
               prompts=4, new_tokens=24, batch_tokens=1024),
}

def _render(tokenizer, rows) -> list[list[int]]:
    return [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
            for r in rows]


# how the demo's target was trained, beside its weights: another size or seed trains it again
TARGET_RECORD = "demo_target.json"


def pretrain_target(out: Path, rows: list[dict], *, hidden: int, layers: int, steps: int,
                    seed: int) -> Path:
    """Train a small Llama on the corpus (next-token loss on whole chats) and save it."""
    import transformers as tf

    from eyas.targets.tiny import tiny_config, tiny_tokenizer

    made = {"hidden": hidden, "layers": layers, "steps": steps, "seed": seed, "rows": len(rows)}
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file() and \
            any(out.glob("*.safetensors")):
        try:
            had = json.loads((out / TARGET_RECORD).read_text())
        except (OSError, ValueError):
            had = None
        if had == made:
            log.info("target already trained at %s", out)
            return out
        # (--fast and the full demo train other sizes): the pipeline then sees other weights
        # behind the same path and runs its steps again
        log.info("the target in %s was trained with %s, not %s: training it again", out, had,
                 made)
    tokenizer = tiny_tokenizer()
    seqs = _render(tokenizer, rows)
    config = tiny_config("llama", vocab_size=1024, num_layers=layers, hidden=hidden)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    rng, pad, batch_size = random.Random(seed), tokenizer.pad_token_id, 16
    start = time.time()
    for step in range(steps):
        batch = rng.sample(seqs, batch_size)
        ids = torch.full((batch_size, max(map(len, batch))), pad)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
        labels = ids.masked_fill(ids == pad, -100)
        # linear warmup then cosine decay to 10%
        warm = min(1.0, (step + 1) / 30)
        cos = 0.55 + 0.45 * torch.cos(torch.tensor(step / steps * 3.14159)).item()
        for group in opt.param_groups:
            group["lr"] = 3e-3 * warm * cos
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log.info("target step %d/%d loss %.3f (%.0fs)", step, steps, loss.item(),
                     time.time() - start)
    # saved beside, then renamed: a demo killed while saving leaves no half target that the
    # next run would take for a trained one (config.json alone, no weights or tokenizer)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / TARGET_RECORD).write_text(json.dumps(made) + "\n")
    as_umask(tmp)  # safetensors writes owner-only
    if out.exists():  # (a half target, or one trained with other settings)
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# what a demo writes in its --out (target.tmp: a target being saved)
DEMO_ENTRIES = ("pipeline.yaml", "data", "target", "target.tmp", "work")


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file, or holds anything but an earlier demo (which the demo
    resumes): the demo writes pipeline.yaml, data/chats.jsonl and target/ there, and would
    overwrite a user's files of those names. A demo folder is known by its pipeline.yaml,
    written first, whose work_dir is the folder's work/."""
    if out.exists() and not out.is_dir():
        raise EyasError(f"--out {out} is a file; give a folder (eyas demo writes a folder).",
                        flag="--out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    try:
        spec = yaml.safe_load((out / "pipeline.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        spec = None
    ours = isinstance(spec, dict) and spec.get("work_dir") == str(out / "work")
    foreign = [n for n in entries if not ours or n not in DEMO_ENTRIES]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                          else "")
        raise EyasError(f"--out {out} holds files an earlier `eyas demo` did not write "
                        f"({shown}); eyas demo writes only into a missing or empty folder or "
                        f"its own earlier output, so nothing of yours is overwritten or "
                        f"deleted. Move those away, or choose another --out.", flag="--out")


def demo(cfg: DemoConfig) -> dict:
    """Run the demo; returns the eval report as a dict."""
    from eyas.pipeline import RunConfig, run

    size = SIZES[cfg.fast]
    out = Path(cfg.out).resolve()
    _check_out(out)
    data = out / "data" / "chats.jsonl"
    pipeline = {
        "target": str(out / "target"), "data": str(data), "work_dir": str(out / "work"),
        "prepare": {"max_length": 512, "eval_fraction": 0.05, "seed": cfg.seed},
        # the target runs in fp32 here, in capture as in eval, so training sees what eval feeds
        "capture": {"dtype": "bf16", "model_dtype": "fp32", "batch_tokens": size["batch_tokens"]},
        "vocab": {"draft_vocab_size": 512},
        # the assistant's positions only: on these templated chats, whose prompts draw random
        # numbers and words, and in a demo's 60-200 steps, the prompts' positions (eyas train's
        # default, measured best on real chats: docs/train.md) cost the draft 4 % / 8 % at
        # k = 3 (full demo 3.09 -> 2.96, --fast 1.37 -> 1.26)
        "train": {"max_steps": size["draft_steps"], "batch_tokens": size["batch_tokens"],
                  "loss_mask_at": "input",
                  "lr": 3e-3, "eval_every": max(size["draft_steps"] // 4, 10),
                  "save_every": max(size["draft_steps"] // 4, 10), "seed": cfg.seed},
        "export": {"dtype": "fp32"},
        "eval": {"k": [1, 2, 3, 4, 5], "num_prompts": size["prompts"],
                 "max_new_tokens": size["new_tokens"], "seed": cfg.seed},
    }
    # written first: it marks the folder as the demo's for a run that resumes a killed one
    yaml_path = out / "pipeline.yaml"
    out.mkdir(parents=True, exist_ok=True)
    yaml_path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    data.parent.mkdir(exist_ok=True)
    rows = synthetic_chats(size["chats"], seed=cfg.seed)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pretrain_target(out / "target", rows, hidden=size["hidden"], layers=size["layers"],
                    steps=size["target_steps"], seed=cfg.seed)
    run(RunConfig(pipeline=str(yaml_path)))
    report = json.loads((out / "work" / "eval" / "report.json").read_text())
    md = out / "work" / "eval" / "report.md"
    if md.is_file():
        print(md.read_text())
    print(f"report: {out / 'work' / 'eval'}  (pipeline: {yaml_path})")
    return report
