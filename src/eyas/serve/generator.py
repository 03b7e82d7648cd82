"""Chat generation with a local transformers model: the engine of `eyas regenerate --backend
transformers` and of the test server `eyas.serve.openai_server`.

`LocalGenerator` renders prompts with the model's chat template (`render_prompt`) and generates
in batches: left-padded through `model.generate`, transformers' continuous batching, or
prompt-lookup speculative decoding. Each answer comes back as a `Generation`, cut at the first
end-of-turn id (`stop_token_ids`, `cut_at_stop`); the vllm backend (eyas.serve.vllm_generate)
and the OpenAI client (eyas.serve.openai_client) answer in the same form.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from eyas.targets.masking import render
from eyas.errors import EyasError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """One generated turn: its text, why generation stopped ("stop" at an end-of-turn token,
    "length" at the token limit) and how many tokens it took."""

    text: str
    finish_reason: str
    num_tokens: int = 0


def stop_token_ids(generation_config, tokenizer, required: bool = True) -> frozenset[int]:
    """End-of-turn ids: the generation config's eos ids (e.g. Llama 3's <|eot_id|>) and the
    tokenizer's eos, the set vLLM stops on. If there are none: an EyasError when `required`
    (generation would never stop), else the empty set (eval measures to max_new_tokens)."""
    ids = set()
    for source in (generation_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else (value or []))
    if required and not ids:
        raise EyasError("the target names no end-of-turn token: set eos_token_id in its "
                        "generation_config.json")
    return frozenset(ids)


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids for the assistant turn that follows `messages` (ChatFormatError where the
    chat template refuses them)."""
    text = render(tokenizer, messages, add_generation_prompt=True,
                  template_kwargs=template_kwargs)
    # The rendered template already holds BOS and every special token it needs.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_at_stop(row: list[int], stop_ids: frozenset[int], tokenizer) -> Generation:
    """The Generation of generated ids `row`: its text up to the first end-of-turn id, "stop"
    if there is one ("length" if not), and the tokens it took (the end-of-turn id included)."""
    end = next((i for i, t in enumerate(row) if t in stop_ids), None)
    text = tokenizer.decode(row[:end], skip_special_tokens=True)
    return Generation(text, "length" if end is None else "stop",
                      len(row) if end is None else end + 1)


BATCHING = ("continuous", "padded", "lookup")
LOOKUP_K = 4  # drafts per step of --batching lookup (prompt lookup, 2..4-token suffixes)
CB_BLOCK_TOKENS = 256  # tokens per block of transformers' paged cache (its default)


class LocalGenerator:
    """Batched chat generation with a transformers model and its chat template.

    batching "continuous": transformers' continuous batching (`model.generate_batch`: a paged
    KV cache where a finished row frees its room for the next prompt at once, so a batch never
    waits for its longest answer); "padded": left-padded batches through `model.generate`,
    which run until their longest row ends; "lookup": prompt-lookup speculative decoding of
    the whole batch (eyas.serve.batched with the n-gram drafter: each row accepts its own
    drafts and leaves the batch when done; exact at any temperature, top_p 1 only, and the
    generation config's other sampling options, e.g. repetition_penalty, are not applied).
    Greedy outputs are the same (tests). Models without `generate_batch` (some remote code)
    or spread over several devices use padded instead of continuous.
    """

    def __init__(self, model, tokenizer, batching: str = "padded", concurrency: int = 64):
        if batching not in BATCHING:
            raise EyasError(f"batching {batching!r}: use one of {BATCHING}")
        devices = set(getattr(model, "hf_device_map", {}).values())
        if batching == "continuous" and (not hasattr(model, "generate_batch")
                                         or len(devices) > 1):
            log.info("continuous batching is not available for this model (%s); using "
                     "padded batches", "spread over several devices" if len(devices) > 1
                     else "no generate_batch")
            batching = "padded"
        self.batching = batching
        self.concurrency = concurrency  # continuous batching: conversations the cache holds
        self.model, self.tokenizer = model, tokenizer
        self.lock = threading.Lock()  # held by callers that share this generator across threads
        self.stop_ids = stop_token_ids(model.generation_config, tokenizer)
        self._batch_target = None  # batching "lookup": made at its first batch
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids)

    def render(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """Prompt ids for the assistant turn that follows `messages`."""
        return render_prompt(self.tokenizer, messages, template_kwargs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> list[Generation]:
        """One Generation per prompt; a batch that runs out of GPU memory is split in two.
        Without cuDNN's attention (eyas.targets.sdpa.target_attention: it plans every
        decode step's new key length on the host)."""
        import torch

        from eyas.targets.sdpa import target_attention

        try:
            with target_attention():
                return self._generate(prompts, max_new_tokens, temperature, top_p)
        except torch.cuda.OutOfMemoryError:
            pass  # retried below, outside this block: the exception's traceback holds the
            # failed forward's frames and so its activations, which must be freed first
        torch.cuda.empty_cache()
        if len(prompts) == 1:
            return [Generation("", "out_of_memory")]
        half = len(prompts) // 2
        log.warning("out of GPU memory with %d prompts; splitting the batch", len(prompts))
        return (self.generate(prompts[:half], max_new_tokens, temperature, top_p)
                + self.generate(prompts[half:], max_new_tokens, temperature, top_p))

    def _config(self, max_new_tokens: int, temperature: float, top_p: float):
        from transformers import GenerationConfig

        # Unset options (e.g. top_k) come from the model's generation_config, as in vLLM.
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p)
                    if temperature > 0 else dict(do_sample=False))
        return GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                eos_token_id=sorted(self.stop_ids), **sampling)

    def _result(self, row: list[int]) -> Generation:
        return cut_at_stop(row, self.stop_ids, self.tokenizer)

    def _generate(self, prompts, max_new_tokens, temperature, top_p) -> list[Generation]:
        if self.batching == "continuous":
            return self._generate_continuous(prompts, max_new_tokens, temperature, top_p)
        if self.batching == "lookup" and top_p == 1.0:
            return self._generate_lookup(prompts, max_new_tokens, temperature)
        return self._generate_padded(prompts, max_new_tokens, temperature, top_p)

    def _generate_lookup(self, prompts, max_new_tokens, temperature) -> list[Generation]:
        import torch

        from eyas.serve.batched import BatchNgramDrafter, BatchTarget, generate_batch
        from eyas.serve.speculate import Sampling
        from eyas.targets.models import inspect_model, submodule

        if self._batch_target is None:
            info = inspect_model(self.model)
            self._batch_target = BatchTarget(self.model, submodule(self.model, info.layers_path),
                                             submodule(self.model, info.norm_path))
        target = self._batch_target
        # sampling: a generator seeded from the global one (which --seed seeds)
        gen = torch.Generator(device=target.device).manual_seed(
            int(torch.randint(2**62, (1,)))) if temperature > 0 else None
        done = generate_batch(target, BatchNgramDrafter(2, 4), [torch.tensor(p) for p in prompts],
                              LOOKUP_K, max_new_tokens, self.stop_ids, Sampling(temperature, gen))
        return [self._result(g.tokens) for g in done]

    def _generate_continuous(self, prompts, max_new_tokens, temperature,
                             top_p) -> list[Generation]:
        from transformers import ContinuousBatchingConfig

        gen_cfg = self._config(max_new_tokens, temperature, top_p)
        # A paged cache for `concurrency` conversations at once, not transformers' default of
        # most of the free memory: without flash attention every forward builds a mask over
        # the whole cache (on the H200 a 127 GB cache made 3000 prompts run for minutes
        # without a result; on a CPU it asked for 13.7 GB in a tiny test).
        longest = max(map(len, prompts)) + max_new_tokens
        blocks = self.concurrency * -(-longest // CB_BLOCK_TOKENS)
        # not under inference_mode: transformers generates in a thread of its own, which
        # updates in place the tensors made here (inference tensors there would refuse it)
        done = list(self.model.generate_batch(
            [list(p) for p in prompts], generation_config=gen_cfg,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks),
            progress_bar=False).values())
        # results come in input order; a request that failed inside transformers is missing
        # or carries an error
        results, at = [], 0
        for p in prompts:
            out = done[at] if at < len(done) else None
            if out is None or list(out.prompt_ids) != list(p):
                results.append(Generation("", "error: no result from continuous batching"))
                continue
            at += 1
            results.append(Generation("", f"error: {out.error}") if out.error is not None
                           else self._result(list(out.generated_tokens)))
        if prompts and all(r.finish_reason.startswith("error") for r in results):
            # every request failed: continuous batching does not work here (its error is in
            # transformers' log); padded batches give the same answers
            log.warning("continuous batching failed for all %d prompts (%s); using padded "
                        "batches from now on", len(prompts), results[0].finish_reason[:200])
            self.batching = "padded"
            return self._generate_padded(prompts, max_new_tokens, temperature, top_p)
        return results

    def _generate_padded(self, prompts, max_new_tokens, temperature, top_p) -> list[Generation]:
        import torch

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column T - 1
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen_cfg = self._config(max_new_tokens, temperature, top_p)
        device = self.model.device
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=gen_cfg)  # (B, T + new)
        return [self._result(row) for row in out[:, width:].tolist()]


def load_generator(model: str | Path, *, dtype: str = "auto", device: str | None = None,
                   device_map: str | None = None, revision: str | None = None,
                   trust_remote_code: bool = False, batching: str = "padded",
                   concurrency: int = 64) -> LocalGenerator:
    """A LocalGenerator for a hub name or folder, loaded through `eyas.targets.models`."""
    from eyas.targets.models import load_target, load_tokenizer

    target, _ = load_target(model, revision=revision, dtype=dtype, device=device,
                            device_map=device_map, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(model, revision=revision, trust_remote_code=trust_remote_code)
    return LocalGenerator(target, tokenizer, batching, concurrency)
