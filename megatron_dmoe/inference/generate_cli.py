"""dmoe-generate: text from a trained run."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.inference.cli_common import (
    add_run_arguments,
    distributed_session,
    fail,
    positive_int,
)

PROG = "dmoe-generate"
DESCRIPTION = """\
Generate text with a trained run's checkpoint and its tokenizer, on a CPU or a GPU.

Each prompt is continued until the end-of-document token, --max-tokens new tokens, or the model's
context length. Greedy by default (--temperature 0); with a temperature > 0 tokens are sampled,
optionally from the top-k and/or top-p (nucleus) set, reproducibly for a given --seed. Keys and
values of earlier tokens are cached (megatron-core's static inference context), so each new token
costs one position's forward pass.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    prompts.add_argument("--prompts", type=Path, metavar="FILE",
                         help="a file of prompts: JSON lines with a \"prompt\" field, or one prompt per line "
                         "(\\n in such a line stands for a newline)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                        help="at most N new tokens per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 = greedy (the default); > 0 samples from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample from the K most likely tokens only (0 = no limit, the default)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample from the smallest set of tokens whose probability reaches P (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt (prompt, completion, tokens, stop_reason) "
                        "instead of the prompt and its completion as text")
    return parser


def _read_prompts(ns) -> List[str]:
    from megatron_dmoe.inference.errors import UsageError

    if ns.prompt is not None:
        return [ns.prompt]
    if not ns.prompts.is_file():
        raise UsageError(f"--prompts {ns.prompts}: no such file")
    lines = [line for line in ns.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError):
                raise UsageError(f"--prompts {ns.prompts} line {n}: a JSON line needs a \"prompt\" field") from None
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise UsageError(f"--prompts {ns.prompts} holds no prompt")
    return prompts


def _encode(cfg, prompts: List[str]) -> List[List[int]]:
    """Token ids of the prompts with the run's tokenizer; each must fit the model's context."""
    from megatron_dmoe.data import DataError
    from megatron_dmoe.inference.errors import UsageError
    from megatron_dmoe.inference.no_data import build_run_tokenizer

    try:
        tok = build_run_tokenizer(cfg)
    except DataError as err:
        raise UsageError(str(err)) from None
    context = cfg.model.max_position_embeddings
    encoded = [tok.tokenize(p) for p in prompts]
    for n, ids in enumerate(encoded, 1):
        if not ids:
            raise UsageError(f"prompt {n} is empty")
        if len(ids) > context:
            raise UsageError(f"prompt {n} has {len(ids)} tokens, more than the model's context of {context} "
                             "(model.max_position_embeddings); shorten it")
    return encoded


def generate_main(argv: Optional[List[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    from megatron_dmoe.console import show_warnings_plainly

    show_warnings_plainly(PROG)
    import torch

    from megatron_dmoe.inference.errors import UsageError
    from megatron_dmoe.inference.generate import generate
    from megatron_dmoe.inference.run_model import find_checkpoint, load_run, read_run_config
    from megatron_dmoe.inference.sampling import Sampling

    try:
        try:
            sampling = Sampling(ns.temperature, ns.top_k, ns.top_p)
        except ValueError as err:
            raise UsageError(str(err)) from None
        prompts = _read_prompts(ns)
        cfg = read_run_config(ns.run_dir)
        find_checkpoint(ns.run_dir, ns.checkpoint)
        encoded = _encode(cfg, prompts)
        context = cfg.model.max_position_embeddings
        results = []
        with distributed_session():
            run = load_run(ns.run_dir, device=ns.device, checkpoint=ns.checkpoint)
            tok = run.tokenizer
            generator = torch.Generator().manual_seed(ns.seed)
            for prompt, ids in zip(prompts, encoded):
                out = generate(run.model, ids, max_new_tokens=ns.max_tokens, context_length=context,
                               eod=tok.eod, vocab_size=run.vocab_size, sampling=sampling, generator=generator,
                               device=run.env.device)
                results.append({"prompt": prompt, "completion": tok.detokenize(out.tokens),
                                "tokens": out.tokens, "stop_reason": out.stop_reason})
    except UsageError as err:
        return fail(PROG, str(err))
    for r in results:
        print(json.dumps(r) if ns.json else r["prompt"] + r["completion"])
    return 0


def main() -> None:
    sys.exit(generate_main())


if __name__ == "__main__":
    main()
