"""Can vLLM on a CPU give the same samples twice? Measured on the shipped tiny model.

::

    python -m stapo_cpu.benchmarks.bench_vllm_determinism [--prompts 4] [--n 8] [--max-tokens 96] [--json out.json]

vLLM's CPU build (fp32, one thread, the CPU path's environment) samples ``--n`` completions of each of
``--prompts`` training prompts, every request with its own seed, in fresh engine processes that differ
only in how the requests reach the engine (:data:`SETTINGS`), and prints, against the first, how many
completions have identical tokens and the largest difference of their log-probs (any difference: the
logits depend on the batch). The measured numbers: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from stapo_core.fileio import atomic_write

#: all in one ``generate`` call, twice; reversed; one per call; all together without per-request seeds
SETTINGS = ("together", "together_again", "reversed", "one_by_one", "unseeded")

ENGINE = r"""
import json, sys
import pyarrow.parquet as pq
from vllm import LLM, SamplingParams
model, train, prompts, n, max_tokens, setting = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
rows = pq.read_table(train).to_pylist()[:prompts]
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, max_num_seqs=64)
tok = llm.get_tokenizer()
requests = []
for p, row in enumerate(rows):
    text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    for k in range(n):
        requests.append(((p, k), list(ids)))
def params(key):
    seed = None if setting == "unseeded" else int.from_bytes(__import__("hashlib").sha256(repr(key).encode()).digest()[:4], "little")
    return SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0, seed=seed)
def run(batch):
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], [params(key) for key, _ in batch], use_tqdm=False)
    return {repr(key): {"tokens": list(o.outputs[0].token_ids),
                        "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]}
            for (key, _), o in zip(batch, outs)}
if setting == "reversed":
    result = run(requests[::-1])
elif setting == "one_by_one":
    result = {}
    for r in requests:
        result.update(run([r]))
else:
    result = run(requests)
print("RESULT " + json.dumps(result))
"""


def run_setting(setting: str, args, env: dict) -> dict:
    from stapo_cpu.assets import SHIPPED_DIR, asset_paths  # torch (through stapo_core) only for a run, not --help

    paths = asset_paths(SHIPPED_DIR)
    proc = subprocess.run([sys.executable, "-c", ENGINE, str(paths.model), str(paths.train), str(args.prompts),
                           str(args.n), str(args.max_tokens), setting.replace("_again", "")],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{setting}: engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(reference: dict, other: dict) -> dict:
    """How many completions of ``other`` have ``reference``'s tokens, and the largest log-prob difference among them."""
    equal = [key for key, ref in reference.items() if other[key]["tokens"] == ref["tokens"]]
    diffs = [abs(a - b) for key in equal for a, b in zip(reference[key]["logprobs"], other[key]["logprobs"])]
    return {"completions": len(reference), "identical_tokens": len(equal),
            "max_abs_dlogprob_where_tokens_equal": max(diffs, default=0.0) if equal else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stapo_cpu.benchmarks.bench_vllm_determinism",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    from stapo_cpu.trainer import cpu_env  # torch and Hydra (through the recipe) only for a run, not --help

    env = cpu_env()
    results = {}
    for setting in SETTINGS:
        print(f"[bench_vllm_determinism] {setting} ...", flush=True)
        results[setting] = run_setting(setting, args, env)
    rows = {setting: compare(results["together"], results[setting]) for setting in SETTINGS[1:]}
    print(f"\n{args.prompts} prompts x {args.n} samples, up to {args.max_tokens} tokens; against the first 'together':")
    print("| setting | completions with identical tokens | max |d logprob| where tokens equal |")
    print("| --- | --- | --- |")
    for setting, row in rows.items():
        dl = row["max_abs_dlogprob_where_tokens_equal"]
        print(f"| {setting} | {row['identical_tokens']}/{row['completions']} | {'-' if dl is None else f'{dl:.3g}'} |")
    if args.json:
        atomic_write(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
