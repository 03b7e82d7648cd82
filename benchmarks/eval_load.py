"""Where a short `eyas eval` spends its time when the target is a GGUF file: the whole
evaluate() against its decoding, for each target given (run each in a fresh process, so no
parse is cached from the one before).

    python benchmarks/eval_load.py --target smol.gguf --draft run/draft --data heldout.jsonl
    python benchmarks/eval_load.py --target smol-hf/ --draft run/draft --data heldout.jsonl

(`smol-hf/`: the same weights as a Hugging Face folder, e.g. from benchmarks/vllm_serve.py's
`hf_folder`.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    from eyas.evaluate import EvalConfig, evaluate

    imported = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        cfg = EvalConfig(target=a.target, draft=a.draft, data=a.data, out=out, k=(3,),
                         max_new_tokens=a.new_tokens, num_prompts=a.prompts,
                         batch_size=a.prompts, dtype="float32", device=a.device,
                         replay=False, ngram=False)
        t1 = time.perf_counter()
        report = evaluate(cfg)
        whole = time.perf_counter() - t1
    result = {"target": a.target, "import_s": round(imported, 1), "evaluate_s": round(whole, 1),
              "decoding_s": round(sum(r.seconds for r in report.results), 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
