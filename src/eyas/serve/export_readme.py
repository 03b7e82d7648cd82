"""README.md of an exported draft: what it is for, how to serve it, how it was trained and what
acceptance was measured. Everything comes from the run's manifests and the eval report, so the
README says nothing the folder cannot back up."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from eyas import __version__
from eyas.draft.formats import EAGLE31_KEYS, SERVED_SINCE, sglang_layer_ids, to_sglang_config
from eyas.errors import EyasError
from eyas.serve.quoted_report import step_number
from eyas.store.manifest import LAYER_ID_CONVENTION

# Train config keys quoted in the README (the whole config stays in eyas.json).
TRAIN_KEYS = ("data", "vocab", "epochs", "max_steps", "lr", "batch_tokens", "grad_accum",
              "ttt_steps", "step_weight", "lm_head", "precision", "seed")
DFLASH_TRAIN_KEYS = ("data", "epochs", "max_steps", "lr", "batch_tokens", "grad_accum",
                     "block_size", "num_anchors", "loss_decay_gamma", "dflash_labels",
                     "precision", "seed")


@dataclass(frozen=True)
class ServedTarget:
    """The target as the serve commands name it: `name` a hub name or an absolute local path,
    `revision` the branch or commit the draft was trained on, `gguf` the .gguf file that
    `name` (a folder) is to be converted from first: vLLM and SGLang read no GGUF."""

    name: str
    revision: str | None = None
    trust_remote_code: bool = False
    gguf: str | None = None

    def flags(self, revision_flag: str = "--revision") -> str:
        """The target's own flags on a server's command line."""
        return (f" {revision_flag} {shlex.quote(self.revision)}" if self.revision else "") + \
            (" --trust-remote-code" if self.trust_remote_code else "")


def served_target(name: str | None, revision: str | None = None,
                  trust_remote_code: bool = False) -> ServedTarget:
    """`name` as a server loads it from anywhere: a local folder absolute, a .gguf file as the
    folder `eyas convert` writes beside it (its README says to convert first)."""
    if not name:
        return ServedTarget("TARGET", revision, trust_remote_code)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        path = path.resolve()
        return ServedTarget(str(path.with_name(path.stem + "-hf")), None, trust_remote_code,
                            gguf=str(path))
    if path.exists():
        name = str(path.resolve())
    return ServedTarget(name, revision, trust_remote_code)


def convert_lines(served: ServedTarget) -> list[str]:
    """For a GGUF target: the conversion the serve commands below need, first."""
    if served.gguf is None:
        return []
    return [f"The target is a GGUF file, which vLLM and SGLang do not serve: convert it once "
            f"into the folder the commands below name (the same weights; a draft trained on "
            f"either serves on both):", "", "```bash",
            f"eyas convert --target {shlex.quote(served.gguf)} --out {shlex.quote(served.name)}",
            "```", ""]


def draft_sampling(report: dict | None) -> str | None:
    """How the quoted `eyas eval` report chose drafts at temperature > 0 (vLLM's
    draft_sample_method), or None: no report, or one at temperature 0, where both ways take the
    argmax. Reports from before the `draft_sampling` field name it in their settings line."""
    if not report or not report.get("temperature"):
        return None
    way = report.get("draft_sampling")
    if way is None:
        sampled = "probabilistic drafts" in str(report.get("settings"))
        way = "probabilistic" if sampled else "greedy"
    return way


def speculative_config(method: str, draft: str, k: int, sampling: str | None) -> dict:
    """vLLM's --speculative-config for the draft, with `sampling` as its draft_sample_method
    when that is not vLLM's default (greedy; None: not measured at T > 0)."""
    spec = {"method": method, "model": draft, "num_speculative_tokens": k}
    if sampling not in (None, "greedy"):
        spec["draft_sample_method"] = sampling
    return spec


def sampling_lines(report: dict | None) -> list[str]:
    """What the serve commands mean for temperature > 0 (docs/eval.md, "Numbers, and how they
    compare with vLLM")."""
    way = draft_sampling(report)
    if way == "probabilistic":
        return [f"The acceptance below was measured at temperature {report['temperature']:g} "
                "with probabilistic drafts, so the vLLM command with `--speculative-config` "
                "carries `\"draft_sample_method\": \"probabilistic\"`; the SGLang command does "
                "not: measure it there before quoting this acceptance for it.", ""]
    if way == "greedy":
        return [f"The acceptance below was measured at temperature {report['temperature']:g} "
                "with greedy drafts, vLLM's default `draft_sample_method`. Probabilistic drafts "
                "usually accept more at temperature > 0 (docs/eval.md): measure them with `eyas "
                "eval --draft-sampling probabilistic` and export with that report.", ""]
    return ["To serve at temperature > 0, measure at that temperature with `eyas eval "
            "--temperature T --draft-sampling probabilistic` and export with that report: the "
            "vLLM command then carries `\"draft_sample_method\": \"probabilistic\"`, which "
            "accepted 14-40 % more than vLLM's default greedy drafts at T = 1 where it was "
            "measured, the more the better the draft (docs/eval.md).", ""]


def serve_commands(fmt: str, target: ServedTarget, draft: str, k: int,
                   report: dict | None = None) -> list[str]:
    """Exact command lines for the format (chain drafting with k tokens; the draft sampling
    of the quoted report, if any), every path and JSON shell-quoted."""
    sampling = draft_sampling(report)
    spec = json.dumps(speculative_config("eagle3", draft, k, sampling))
    vllm = (f"vllm serve {shlex.quote(target.name)}{target.flags()} \\\n"
            f"    --speculative-config {shlex.quote(spec)}")
    if fmt == "vllm":
        return [vllm]
    if fmt == "speculators":  # the verifier is read from config.json (it has no revision)
        alone = f"vllm serve {shlex.quote(draft)}" + \
            (" --trust-remote-code" if target.trust_remote_code else "")
        # the short form serves vLLM's default greedy drafts: not what a report measured with
        # probabilistic ones, nor another revision than the default branch
        return [vllm] if target.revision or sampling not in (None, "greedy") else [alone, vllm]
    return [f"python -m sglang.launch_server --model-path {shlex.quote(target.name)}"
            f"{target.flags()} \\\n"
            f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path "
            f"{shlex.quote(draft)} \\\n"
            f"    --speculative-num-steps {k} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k + 1}", vllm]


def _sglang_line(dcfg, num_target_layers: int | None) -> str:
    """Whether `--format sglang` would export this draft, as export itself decides it
    (to_sglang_config): said so, or why not."""
    try:
        to_sglang_config(dcfg, num_target_layers=num_target_layers)
    except EyasError as err:
        return f"- not for SGLang as trained: `--format sglang` refuses it. {err}"
    return ("- for SGLang, export again with `--format sglang`: SGLang reads these ids one "
            "layer later")


def render_readme(cfg, dcfg, out: Path, served: ServedTarget, train: dict | None,
                  step: Path, report: dict | None) -> str:
    """cfg: ExportConfig; dcfg: DraftConfig; served: the target as the commands name it;
    train: the run's manifest (or None)."""
    target = (train or {}).get("target") or {}
    name = served.name
    draft = str(Path(out).resolve())
    lines = [f"# EAGLE-3 draft for {name}", "",
             f"Format **{cfg.format}** (`{cfg.resolved_layout}.*` weights, {cfg.dtype}), written "
             f"by eyas {__version__} from `{step}`.", "", "## Serve", ""]
    lines += convert_lines(served)
    for cmd in serve_commands(cfg.format, served, draft, cfg.num_speculative_tokens, report):
        lines += ["```bash", cmd, "```", ""]
    if cfg.format == "speculators" and served.revision:
        lines += [f"The verifier record in config.json has no revision, so `vllm serve` of this "
                  f"folder alone would load the target's default branch, not revision "
                  f"{served.revision} that the draft was trained on: serve it as above.", ""]
    lines += sampling_lines(report)
    lines += [f"Replace `{draft}` with where this folder lives (or its hub name). If vLLM says "
              "\"Model does not support EAGLE3 interface\", install eyas in the serving "
              "environment: its vLLM plugin adds the interface to wrapper models (see "
              "`eyas doctor TARGET`; `EYAS_VLLM_PLUGIN=0` turns it off).", ""]
    ids = list(dcfg.aux_layer_ids)
    lines += target_lines(name, target, dcfg.target_hidden_size, dcfg.vocab_size) + [
        f"- aux layer ids {ids} ({LAYER_ID_CONVENTION})"]
    if cfg.format == "vllm":
        lines.append(_sglang_line(dcfg, target.get("num_hidden_layers")))
        if dcfg.num_hidden_layers == 1 and dcfg.norm_before_fc:
            lines.append("- for a speculators folder, export again with `--format "
                         "speculators`: `speculators convert` (0.9.0) of this folder drops "
                         "`input_norm.weight` (\"Unexpected keys in checkpoint\"), so the "
                         "converted draft is not the one trained")
    if cfg.format == "sglang":
        lines.append(f"- SGLang reads `eagle_config` ids {sglang_layer_ids(ids)}: it adds 1 and "
                     f"captures that layer's input, i.e. the same residual streams")
    lines += ["", "## Draft", "",
              f"- hidden {dcfg.hidden_size} (target {dcfg.target_hidden_size}), heads "
              f"{dcfg.num_attention_heads} (kv {dcfg.num_key_value_heads}, head_dim "
              f"{dcfg.head_dim}), intermediate {dcfg.intermediate_size}",
              f"- draft vocabulary {dcfg.draft_vocab_size} of {dcfg.vocab_size} target ids "
              + ("(d2t/t2d)" if dcfg.maps_vocab else "(the whole vocabulary: no d2t/t2d)"),
              f"- norm_before_residual {dcfg.norm_before_residual}, norm_before_fc "
              f"{dcfg.norm_before_fc}, fc_norm {dcfg.fc_norm}, norm_output {dcfg.norm_output}, "
              f"rope_theta {dcfg.rope_theta:g}, rope_scaling {dcfg.rope_scaling}, "
              f"max_position_embeddings {dcfg.max_position_embeddings}"]
    if dcfg.num_hidden_layers > 1:
        lines.append(f"- {dcfg.num_hidden_layers} decoder layers (the layers after the first "
                     f"are `layers.1.*` to `layers.{dcfg.num_hidden_layers - 1}.*`), run as "
                     f"vLLM's llama_eagle3 runs them (checked in vLLM 0.24.0's source; older "
                     f"releases refuse `layers.1.*`); SGLang runs them otherwise: not for SGLang")
    variants = [k for k in EAGLE31_KEYS if getattr(dcfg, k)]
    if variants:
        since = SERVED_SINCE[cfg.format]
        lines.append("- EAGLE 3.1 (" + ", ".join(variants) + "): served as trained by "
                     + ", ".join(f"{since[k]} or later ({k})" for k in variants)
                     + "; older servers do not build these norms")
    lines.append("")
    lines += training_lines(train, step) + acceptance_lines(report, draft, served)
    return "\n".join(lines) + "\n"


def target_lines(name: str, target: dict, hidden: int, vocab: int) -> list[str]:
    """The README's "Target" section: the model the draft was trained on, as its run recorded
    it (`target`; `hidden` and `vocab` from the draft where the run recorded none)."""
    return ["## Target", "",
            f"- model: `{name}`" + (f" (revision {target['revision']})"
                                    if target.get("revision") else "")
            + (f", commit {target['commit']}" if target.get("commit") else ""),
            f"- model_type {target.get('model_type', '?')}, "
            f"{target.get('num_hidden_layers', '?')} layers, hidden "
            f"{target.get('hidden_size', hidden)}, vocab {target.get('vocab_size', vocab)}"]


def training_lines(train: dict | None, step: Path, keys: tuple = TRAIN_KEYS) -> list[str]:
    """The README's "Training" section: how the run in `train` (its manifest) trained, and
    what its replay measured for the exported `step`; `keys`: the settings to list."""
    if train is None:
        return ["## Training", "", "Not recorded (the checkpoint had no run manifest).", ""]
    config, best = train.get("config") or {}, train.get("best") or {}
    if train.get("complete") is False:  # killed, or still training, when it was exported
        head = ("`eyas train`, **unfinished** (the run had not ended when this step was "
                "exported; its schedule had steps left)")
    else:
        head = f"`eyas train`, {train.get('steps', '?')} optimizer steps"
    # the run's manifest scores its best step only: --which last or step-N exports another
    exported = _step_of(step)
    if best.get("step") and exported is None:
        head += (f"; the exported checkpoint ({step.name}) records no step, and the best step "
                 f"{best['step']} had {_simulated(best)} on held-out data")
    elif best.get("step") and best["step"] == exported:
        head += f"; exported step {exported} had {_simulated(best)} on held-out data"
    elif best.get("step"):
        head += (f"; exported step {exported}, not the best step {best['step']}, which had "
                 f"{_simulated(best)} on held-out data")
    out = ["## Training", "", head + ". Settings:", ""]
    out += [f"- {k}: {config[k]}" for k in keys if config.get(k) not in (None, "", ())]
    out += ["", "The full configuration and input manifests are in `eyas.json`.", ""]
    return out


def _step_of(step: Path) -> int | None:
    """The training step of checkpoint folder `step`: N of a step-N folder, else (a folder
    saved under a name of the user's) the step its weights file records."""
    from safetensors import SafetensorError, safe_open

    number = step_number(step)
    if number is None:
        try:
            with safe_open(str(step / "draft.safetensors"), "pt") as f:
                number = int((f.metadata() or {})["step"])
        except (OSError, KeyError, ValueError, SafetensorError):
            return None
    return number


def acceptance_lines(report: dict | None, draft: str, target: ServedTarget,
                     most_k: int | None = None) -> list[str]:
    """The README's "Measured acceptance": the report's table, or the command that measures
    it (at k up to `most_k`, a DFlash block's drafts, where given)."""
    if report is None:
        name = shlex.quote(target.gguf or target.name)  # eyas reads the GGUF itself
        ks = ",".join(str(k) for k in sorted({1, 2, 3, 5, 7, most_k or 7})
                      if k <= (most_k or 7))
        return ["## Measured acceptance", "", "Not measured yet: `eyas eval --target "
                f"{name}{target.flags()} --draft {shlex.quote(draft)} --data PROMPTS --out "
                f"REPORT --k {ks}`, then re-export with `--acceptance-report REPORT`.", ""]
    al, per = report.get("mean_acceptance_length") or {}, report.get("per_position_acceptance") or {}
    speed = {str(r.get("k")): r.get("speedup") for r in report.get("results") or []
             if r.get("method") == report.get("primary")}
    out = ["## Measured acceptance", "",
           f"`eyas eval`: {report.get('num_prompts', '?')} prompts, temperature "
           f"{report.get('temperature', '?')}, {report.get('settings', '')}, "
           f"{report.get('max_new_tokens', '?')} new tokens, {report.get('device', '?')} "
           f"{report.get('dtype', '')}; lossless check: {report.get('lossless')}. Mean acceptance "
           "length counts the bonus token.", "",
           "| k | mean acceptance length | acceptance by position | speedup |",
           "|---|---|---|---|"]
    for k in sorted(al, key=int):
        rates = ", ".join(f"{r:.2f}" for r in per.get(k) or [])
        sp = speed.get(k)
        length = f"{al[k]:.3f}" if al[k] is not None else "-"
        out.append(f"| {k} | {length} | {rates} | {f'{sp:.2f}x' if sp else '-'} |")
    return out + [""]


def _simulated(best: dict) -> str:
    """Training's simulated acceptance of the exported step: chain decoding replayed on its
    eval set per k (runs from before the replay have the per-step product only)."""
    chain = best.get("chain_by_k")
    if chain:
        shown = ", ".join(f"k={k}: {al:.3f}" for k, al in chain.items() if al is not None)
        return f"acceptance length replayed as vLLM counts it ({shown})"
    if best.get("sim_acceptance_length") is None and best.get("acceptance_length") is not None:
        return f"acceptance length {best['acceptance_length']:.3f} (DFlash blocks, replayed)"
    return f"simulated acceptance length {best['sim_acceptance_length']:.3f}"
