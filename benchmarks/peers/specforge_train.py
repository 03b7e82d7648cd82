"""Train SpecForge's EAGLE-3 draft on an eyas capture, for a like-for-like comparison with
`eyas train` (GitHub issue 31, item 1).

Same captured tokens (the eyas capture's aux states and final hidden states), same draft
vocabulary (the eyas vocab's d2t/t2d), same train/eval split, same epochs and about the same
tokens per optimizer step; everything else is SpecForge's own EAGLE-3 recipe (PyPI `specforge`
0.2.0, sgl-project), run through its own entry point (`specforge train --config RUN.yaml`,
offline mode: hidden states from disk, no SGLang). The result is written as a vLLM-layout draft
folder that `eyas eval --draft OUT/draft` reads, plus `peer.json` (version, recipe as used,
steps, time).

    python benchmarks/peers/specforge_train.py --capture run/captured --vocab run/vocab \
        --target smol-hf --out run/peer-specforge --epochs 10 --batch-tokens 16384

Conversions at the edges, nothing else:
1. capture -> SpecForge's offline feature files (`data_{i:08d}.ckpt`, torch.save of
   `input_ids` (T,), `loss_mask` (T,), `hidden_state` (1, T, H) = the final hidden state AFTER
   the target's final norm (what SGLang hands its logits processor, and what SpecForge's frozen
   TargetHead multiplies by lm_head with no norm of its own: eyas stores the same state, so it
   goes in unchanged), `aux_hidden_state` (1, T, 3H) = the three aux states concatenated low to
   high). Train samples only, in eyas's order; the eval samples stay out.
2. eyas's d2t/t2d -> SpecForge's vocab-mapping file (torch.save {"d2t", "t2d"}; both use
   d2t as offsets, target = draft + d2t[draft]).
3. Layer ids: SpecForge (like SGLang) names an aux state "output of layer i", vLLM and eyas
   "input of layer k" = output of layer k - 1; SpecForge's default (1, L//2-1, L-4) is vLLM's
   (2, L//2, L-3) - 1. Offline training reads the tensors and never the ids; the draft config
   handed to SpecForge carries the capture's ids in SpecForge's convention (eyas's
   `sglang_layer_ids`), and the vLLM folder carries the capture's own ids.
4. The target folder is seen through `OUT/target`, links to its files plus a
   `model.safetensors.index.json` when it has none (SpecForge's TargetHead reads lm_head only
   through an index), and a tied lm_head is read from the embedding key.
5. SpecForge's final checkpoint (`training_state.pt`, `draft_state_dict` with SGLang's names:
   `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) -> vLLM layout via eyas's config
   mapping, checked by eyas's export validator. SpecForge's `norm_output` (True by default)
   means "norm before lm_head", which every EAGLE-3 does; vLLM's `norm_output` (EAGLE 3.1) also
   feeds the normed state to the next step, which SpecForge's TTT does not: the key is dropped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO / "src"))

sys.path.insert(0, str(Path(__file__).parent))
from speculators_train import eyas_split, run_logged, write_vllm_folder  # noqa: E402

log = logging.getLogger("specforge_train")

# SpecForge's entry point, as its console script `specforge` runs it (a --target install has no
# console script)
SPECFORGE_MAIN = "import sys; from specforge.cli import main; sys.exit(main())"
RUN_ID = "eyas-peer"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capture", required=True, help="`eyas capture` output folder")
    p.add_argument("--vocab", required=True, help="`eyas vocab` output folder (d2t/t2d)")
    p.add_argument("--target", required=True,
                   help="the target's local HF folder (SpecForge reads its config, embedding "
                        "and lm_head from it)")
    p.add_argument("--out", required=True, help="output folder (data, checkpoints, draft/)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the train split")
    p.add_argument("--batch-tokens", type=int, default=16384,
                   help="tokens per optimizer step: SpecForge batches whole samples, so this "
                        "sets training.accumulation_steps = round(batch_tokens / (batch_size x "
                        "mean train sample length))")
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per micro-batch (SpecForge's training.batch_size; its "
                        "examples use 1; larger ones pad to the longest sample)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0 = all epochs)")
    p.add_argument("--num-workers", type=int, default=4,
                   help="SpecForge's feature-loader workers (data.dataloader_num_workers)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="held-out share when the capture has no eval split (default: eyas "
                        "train's --eval-fraction default)")
    p.add_argument("--seed", type=int, default=None,
                   help="eyas's split seed (default: eyas train's); SpecForge keeps its own seed")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ 1. inputs


def write_features(src, ids: np.ndarray, data: Path) -> int:
    """SpecForge's offline feature files for samples `ids`, in that order (file i holds sample
    ids[i]; SpecForge lists them sorted by name); returns the tokens written."""
    data.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-sample tensors: intra-op threads only add barriers
    tokens = 0
    try:
        for i, sid in enumerate(ids):
            # clones: safetensors >= 0.8 slices are views of the whole part file's storage,
            # and torch.save writes a view's whole storage (a 1 GB part per sample file)
            s = src.capture.sample(int(sid))
            aux = s["aux_hidden"]                                   # (T, 3, H) low -> high
            t = aux.shape[0]
            torch.save({"input_ids": s["input_ids"].long().clone(),         # (T,)
                        "loss_mask": s["loss_mask"].long().clone(),         # (T,)
                        "hidden_state": s["final_hidden"][None].clone(),    # (1, T, H)
                        "aux_hidden_state": aux.reshape(1, t, -1).clone()},  # (1, T, 3H)
                       data / f"data_{i:08d}.ckpt")
            tokens += t
    finally:
        torch.set_num_threads(threads)
    return tokens


def target_view(target: Path, view: Path) -> tuple[Path, str]:
    """`view`: links to every file of `target`, plus a safetensors index when it has none;
    returns it and the lm_head key (the embedding's for a tied head)."""
    view.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        link = view / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    indexes = sorted(target.glob("*.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
    else:
        weight_map = {}
        for f in sorted(target.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                weight_map.update({k: f.name for k in h.keys()})
        if not weight_map:
            raise SystemExit(f"{target}: no *.safetensors weights; SpecForge reads lm_head "
                             f"and the embedding from safetensors")
        (view / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    if "lm_head.weight" in weight_map:
        return view, "lm_head.weight"
    if "model.embed_tokens.weight" in weight_map:  # tied head (SmolLM2): the embedding's rows
        return view, "model.embed_tokens.weight"
    raise SystemExit(f"{target}: neither lm_head.weight nor model.embed_tokens.weight found")


def draft_config(run: dict, d2t: torch.Tensor, aux: list[int]) -> dict:
    """SpecForge's own draft config for this target (what it derives when none is given),
    with the eyas vocab's size and the capture's ids in SpecForge's convention."""
    from eyas.draft.formats import sglang_layer_ids
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.config import Config
    from specforge.training.model_loading import resolve_draft_config

    derive = {**run, "model": {k: v for k, v in run["model"].items()
                               if k != "draft_model_config"}}
    cfg = Config.model_validate(derive)
    config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    out = config.to_dict()
    out["draft_vocab_size"] = int(d2t.numel())
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(aux),
                           "use_aux_hidden_state": True}
    return out


def run_config(args, out: Path, target: Path, lm_head_key: str, max_length: int,
               accumulation: int, max_steps: int) -> dict:
    """SpecForge's typed run config: data, vocab, sizes and topology; no recipe key, so the
    run uses exactly what SpecForge defaults to (lr, warmup, clip, TTT length, loss, ...)."""
    training = {"strategy": "eagle3", "num_epochs": args.epochs,
                "batch_size": args.batch_size, "accumulation_steps": accumulation,
                "log_interval": 1}
    if max_steps:
        training["max_steps"] = max_steps
    if args.device == "cpu":  # FlexAttention (its default) has no backward on CPU, FSDP no
        # CPU at all: sdpa, and NO_SHARD, which SpecForge runs through DDP (one process either way)
        training.update(attention_backend="sdpa", fsdp_sharding="NO_SHARD")
    return {
        "model": {"target_model_path": str(target), "lm_head_key": lm_head_key,
                  "draft_model_config": str(out / "draft_config.json"),
                  "vocab_mapping_path": str(out / "vocab_mapping.pt"),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(out / "specforge-data"), "max_length": max_length,
                 "cache_dir": str(out / "cache"), "dataloader_num_workers": args.num_workers},
        "training": training,
        "run_id": RUN_ID, "output_dir": str(out / "checkpoints"),
        "deployment": {"mode": "local_colocated",
                       "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


# ------------------------------------------------------------------------------ 2. train


def _specforge_on_cpu(argv: list[str]) -> int:
    """`specforge ARGV` on a machine without an accelerator, for the CPU smoke test only.

    SpecForge's EAGLE-3 loss is a Triton kernel (specforge/core/loss.py imports triton at the
    top, and Triton kernels need a GPU). Here, and only when Triton is missing, a stand-in
    module lets that file import, and the loss is SpecForge's own reference implementation in
    the same file (`_compute_loss`: the same masked soft cross-entropy, mean over B*T). The
    H200 run uses the plain entry point and the Triton kernel."""
    import types

    if importlib.util.find_spec("triton") is None:
        class _Anything(types.ModuleType):
            def __getattr__(self, name):  # tl.constexpr and the like; no __path__
                if name.startswith("__"):
                    raise AttributeError(name)
                return object

        triton = _Anything("triton")
        triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        triton.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
        triton.language = _Anything("triton.language")
        torch.compile(lambda x: x)  # torch's own Triton probes run before the stand-in exists

        sys.modules.update({"triton": triton, "triton.language": triton.language})
        try:
            import specforge.core.loss as loss
        finally:  # nothing else sees the stand-in
            del sys.modules["triton"], sys.modules["triton.language"]
    import specforge.core.loss as loss
    from specforge.cli import main as specforge_main

    class ReferenceLoss:
        apply = staticmethod(loss._compute_loss)

    loss.LogSoftmaxLoss = ReferenceLoss
    return specforge_main(argv)


def run_specforge(args, out: Path) -> tuple[Path, list[str]]:
    """`specforge train --config OUT/run.yaml`; returns its log and the command."""
    launcher = [__file__, "--specforge-on-cpu"] if args.device == "cpu" \
        else ["-c", SPECFORGE_MAIN]
    cmd = [sys.executable, *launcher, "train", "--config", str(out / "run.yaml")]
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", SPECFORGE_DEVICE="cpu")
    return run_logged(cmd, env, out, "specforge"), cmd


def last_checkpoint(checkpoints: Path) -> Path:
    steps = sorted((p for p in checkpoints.glob(f"{RUN_ID}-step*")
                    if p.name.rsplit("step", 1)[1].isdigit() and
                    (p / "training_state.pt").is_file()),
                   key=lambda p: int(p.name.rsplit("step", 1)[1]))
    if not steps:
        raise SystemExit(f"SpecForge wrote no checkpoint under {checkpoints}")
    return steps[-1]


# ------------------------------------------------------------------------------ 3. export


def to_vllm_folder(state: dict, spec_config: dict, aux: list[int], d2t: torch.Tensor,
                   t2d: torch.Tensor, dest: Path) -> dict:
    """SpecForge draft weights (its names) + its draft config -> vLLM-layout EAGLE-3 folder;
    returns the config written."""
    from eyas.draft.formats import from_vllm_config, sglang_layer_ids

    spec_ids = spec_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if list(spec_ids) != sglang_layer_ids(aux):
        raise SystemExit(f"draft config ids {spec_ids} are not the capture's {aux} minus one")
    if spec_config.get("norm_output", True) is not True:
        raise SystemExit("SpecForge's norm_output=false (logits without the final norm) has "
                         "no vLLM equivalent")
    layer = {k: v for k, v in spec_config.items() if k not in ("norm_output", "eagle_config")}
    # vLLM's convention: the capture's own ids; its norm_output (normed recurrence) is off
    cfg = from_vllm_config({**layer, "eagle_aux_hidden_state_layer_ids": list(aux)})
    tensors = {n: t for n, t in state.items() if not n.startswith("embed_tokens.")}
    return write_vllm_folder(dest, cfg, tensors, d2t, t2d, source="the SpecForge checkpoint")


# ------------------------------------------------------------------------------ main


def main(argv=None) -> Path:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    from eyas.store.vocab import load_vocab
    from specforge.config import Config
    from specforge.export.checkpoint_io import resolve_training_state

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    d2t, t2d, _ = load_vocab(args.vocab)
    src, train_ids, eval_ids = eyas_split(Path(args.capture), args.eval_fraction, args.seed)
    aux = [int(i) for i in src.manifest["aux_layer_ids"]]
    lengths = src.lengths[train_ids]
    # whole samples per step: the accumulation that lands closest to --batch-tokens
    accumulation = max(1, round(args.batch_tokens / (args.batch_size * float(lengths.mean()))))
    # SpecForge refuses a run whose last accumulation window is incomplete: stop at the last
    # whole step instead (fewer than `accumulation` micro-batches of the last epoch unused)
    micro = len(train_ids) // args.batch_size * args.epochs  # SpecForge drops a partial batch
    whole = micro // accumulation
    if whole == 0:
        raise SystemExit(f"{micro} micro-batches make no step of {accumulation}: lower "
                         f"--batch-tokens or --batch-size")
    max_steps = min(args.max_steps or whole, whole) if micro % accumulation else args.max_steps

    t0 = time.time()
    tokens = write_features(src, train_ids, out / "specforge-data")
    torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")
    target, lm_head_key = target_view(Path(args.target).resolve(), out / "target")
    run = run_config(args, out, target, lm_head_key, int(lengths.max()), accumulation,
                     max_steps)
    spec_config = draft_config(run, d2t, aux)
    (out / "draft_config.json").write_text(json.dumps(spec_config, indent=2) + "\n")
    (out / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    t1 = time.time()
    log.info("converted %d train samples (%d tokens) in %.1f s", len(train_ids), tokens, t1 - t0)
    log_path, cmd = run_specforge(args, out)
    t2 = time.time()

    ckpt = last_checkpoint(out / "checkpoints")
    state = resolve_training_state(str(ckpt))
    config = to_vllm_folder(state["draft_state_dict"], spec_config, aux, d2t, t2d, out / "draft")
    resolved = Config.model_validate(run).model_dump()
    peer = {
        "peer": "specforge",
        "specforge_version": importlib.metadata.version("specforge"),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "device": args.device,
        "capture": str(Path(args.capture).resolve()), "vocab": str(Path(args.vocab).resolve()),
        "target": args.target,
        "train_samples": int(len(train_ids)), "eval_samples": int(len(eval_ids)),
        "train_tokens": int(lengths.sum()),
        "aux_layer_ids": aux,
        "specforge_aux_layer_ids": spec_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "draft_vocab_size": int(d2t.numel()),
        "epochs": args.epochs, "batch_tokens": args.batch_tokens,
        "tokens_per_step": round(args.batch_size * accumulation * float(lengths.mean()), 1),
        "max_steps": args.max_steps, "accumulation_steps": accumulation,
        "unused_micro_batches": micro - accumulation * (max_steps or whole),
        "recipe": resolved["training"], "model": resolved["model"], "data": resolved["data"],
        "draft_config_specforge": spec_config,
        "steps": int(state.get("global_step") or 0),
        "checkpoint": str(ckpt), "draft": str(out / "draft"),
        "draft_config": {k: config.get(k) for k in ("norm_before_residual", "norm_before_fc",
                                                    "fc_norm", "norm_output",
                                                    "eagle_aux_hidden_state_layer_ids")},
        "wall_s": {"convert_data": round(t1 - t0, 1), "train": round(t2 - t1, 1),
                   "total": round(time.time() - t0, 1)},
        "train_log": str(log_path), "command": cmd,
    }
    (out / "peer.json").write_text(json.dumps(peer, indent=1) + "\n")
    log.info("draft written to %s; peer.json beside it", out / "draft")
    return out / "draft"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--specforge-on-cpu"]:
        sys.exit(_specforge_on_cpu(sys.argv[2:]))
    main()
