"""The folder of an exported DFlash draft, as vLLM's `DFlashQwen3ForCausalLM` (`method:
"dflash"`) and SGLang's DFLASH worker load it: `config.json` (eyas.draft.formats.
to_dflash_config), `model.safetensors` under the draft's own names, which are vLLM's (no
`model.` prefix: vLLM adds it; no `embed_tokens` / `lm_head`: vLLM then shares the target's,
as the draft was trained with them), a README with the serve commands. Validated key by key
before it is written (docs/dflash.md, sections 2-3)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from eyas.dflash.config import DFlashConfig
from eyas.dflash.formats import from_dflash_config, to_dflash_config
from eyas.draft.formats import DTYPES
from eyas.errors import EyasError
from eyas.serve.export_readme import (DFLASH_TRAIN_KEYS, ServedTarget, acceptance_lines,
                                      convert_lines, draft_sampling, sampling_lines,
                                      speculative_config, target_lines, training_lines)


def dflash_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of an exported DFlash draft with its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,),
             "input_layernorm": (h,), "post_attention_layernorm": (h,),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {"fc.weight": (h, len(cfg.aux_layer_ids) * h), "hidden_norm.weight": (h,),
           "norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        out.update({f"layers.{n}.{name}.weight": shape for name, shape in layer.items()})
    return out


def dflash_tensors(cfg: DFlashConfig, state: dict[str, torch.Tensor],
                   dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in the export dtype, checked against `dflash_shapes` and for
    NaN or Inf (as an EAGLE-3 export's are: a diverged run's weights would serve as a draft
    that is never accepted)."""
    want = dflash_shapes(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = [f"{k} {tuple(state[k].shape)} != {want[k]}" for k in want
             if k in state and tuple(state[k].shape) != want[k]]
    if missing or extra or wrong:
        raise EyasError(f"the DFlash checkpoint does not match its config: missing {missing}, "
                        f"unexpected {extra}, wrong shapes {wrong}")
    out = {k: state[k].to(DTYPES[dtype]).contiguous() for k in want}
    bad = [k for k, t in out.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        raise EyasError(f"weight(s) {bad[:3]}{' ...' if len(bad) > 3 else ''} of the DFlash "
                        f"checkpoint hold NaN or Inf; export an earlier checkpoint")
    return out


def dflash_config_json(cfg: DFlashConfig, dtype: str, num_target_layers: int | None) -> dict:
    """to_dflash_config, read back once to prove the round trip before anything is written."""
    config = to_dflash_config(cfg, dtype, num_target_layers)
    if from_dflash_config(json.loads(json.dumps(config))) != cfg:
        raise EyasError("internal: the DFlash config.json does not read back as the trained "
                        "config; please report this")
    return config


def dflash_readme(cfg: DFlashConfig, draft: str, target: ServedTarget, step: str,
                  best: dict | None, served_k: int | None = None, report: dict | None = None,
                  unfinished: bool = False, train: dict | None = None,
                  sglang_refused: str = "") -> str:
    """The export's README: what the draft is, how vLLM and SGLang serve it (`served_k` draft
    tokens, at most the block's), the target and training the run recorded (`train`: its
    manifest) and, given `eyas eval`'s report, its measured acceptance. `unfinished`: the run
    had not ended when `step` was exported; `sglang_refused`: why SGLang cannot serve it (its
    command is left out)."""
    k = cfg.block_size - 1
    spec = json.dumps(speculative_config("dflash", draft, served_k or k, draft_sampling(report)))
    al = (best or {}).get("acceptance_length")
    if al and not step.endswith(f"step-{best['step']:08d}"):  # the best's, not this step's
        al = f"{al} at the run's best step {best['step']}, not this one"
    name = shlex.quote(target.name)
    return "\n".join([
        "# DFlash draft (eyas)", "",
        f"Block-parallel draft for `{target.name}`: {cfg.num_hidden_layers} Qwen3-style "
        f"layer(s) over target layers {list(cfg.aux_layer_ids)} (vLLM's aux ids; DFlash "
        f"`target_layer_ids` {list(cfg.target_layer_ids)}), blocks of {cfg.block_size} "
        f"(bonus + {k} drafts), mask token {cfg.mask_token_id}. It uses the target's "
        f"embedding and lm_head (not in this folder).", "",
        f"Trained checkpoint: `{step}`" + (
            " (**unfinished**: the run had not ended when this step was exported; its "
            "schedule had steps left)" if unfinished else "")
        + (f"; acceptance length on the training run's eval set at k = {k}: {al}" if al else "")
        + ".", "", *convert_lines(target),
        "## vLLM (`method: dflash`; the draft's non-causal attention needs the FLASH_ATTN "
        "backend)", "", "```bash", f"vllm serve {name}{target.flags()} \\",
        f"    --speculative-config {shlex.quote(spec)}", "```", "",
        f"`num_speculative_tokens` may be anything up to {k}.", "", *sampling_lines(report),
        *(["## SGLang", "", f"Not served by SGLang: {sglang_refused}.", ""] if sglang_refused
          else ["## SGLang (`--speculative-num-draft-tokens` counts the bonus token)", "",
                "```bash",
                f"python -m sglang.launch_server --model-path {name}{target.flags()} \\",
                f"    --speculative-algorithm DFLASH --speculative-draft-model-path "
                f"{shlex.quote(draft)} \\",
                f"    --speculative-num-draft-tokens {(served_k or k) + 1}", "```", ""]),
        f"Replace `{draft}` with where this folder lives (or its hub name).", "",
        *target_lines(target.name, (train or {}).get("target") or {}, cfg.hidden_size,
                      cfg.vocab_size),
        f"- target layers tapped: {list(cfg.aux_layer_ids)} (vLLM's aux ids)", "",
        *training_lines(train, Path(step), DFLASH_TRAIN_KEYS),
        *acceptance_lines(report, draft, target, most_k=k)])
