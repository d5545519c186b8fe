"""dmoe-export: a trained run as a transformers model directory."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.inference.cli_common import (
    add_run_arguments,
    distributed_session,
    fail,
    unwritable_output,
    write_failure_message,
)

PROG = "dmoe-export"
FORMATS = ("hf",)
DESCRIPTION = """\
Export a trained run's checkpoint as a transformers model directory (config.json, model.safetensors,
generation_config.json, tokenizer.model and tokenizer_config.json), loadable offline with
AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT).

  dense GPT (LayerNorm, learned positions, GELU)            -> GPT2LMHeadModel
  MoE in every layer, SwiGLU experts, RMSNorm, RoPE, no linear biases, softmax top-k routing
  renormalised over the chosen experts                      -> MixtralForCausalLM
  the same with a query/key norm per head / over the projection
                                                            -> Qwen3MoeForCausalLM / OlmoeForCausalLM
  multi-latent attention, dense first layers, shared experts, softmax (or sigmoid with expert
  bias) routing, group-limited or not          -> DeepseekV2ForCausalLM (DeepseekV3ForCausalLM)
  every other model (the quick-start and zoo GPT MoEs: LayerNorm, GELU experts, learned or
  rotary positions, biases, shared experts, dense layers)  -> DmoeGptForCausalLM, its modeling
                                                               file modeling_dmoe_gpt.py in OUT:
  AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

Token-dropping models (moe.expert_capacity_factor) are refused: transformers would route every
token. A checkpoint saved at any expert-parallel size exports the same. Runs in one process on the
CPU.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, device=False)
    parser.add_argument("out", type=Path, metavar="OUT", help="the directory to write (new, or empty)")
    parser.add_argument("--format", default="hf", metavar="FORMAT",
                        help=f"output format: {', '.join(FORMATS)} (transformers; the default)")
    return parser


def export_main(argv: Optional[List[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.format not in FORMATS:
        return fail(PROG, f"--format {ns.format!r} is not supported; use one of: {', '.join(FORMATS)}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return fail(PROG, "run dmoe-export as one process (not under torchrun): it loads any checkpoint whole")
    from megatron_dmoe.export.dmoe_gpt import ARCHITECTURE, MODELING_FILE
    from megatron_dmoe.export.hf_architecture import DMOE_GPT, hf_architecture, why_not_stock
    from megatron_dmoe.inference.errors import UsageError
    from megatron_dmoe.inference.run_model import find_checkpoint, load_run, read_run_config

    try:
        from megatron_dmoe.export.hf import check_safetensors, export_hf

        check_safetensors()
        # everything that can be refused from the run directory alone, before building anything
        architecture = hf_architecture(read_run_config(ns.run_dir))
        find_checkpoint(ns.run_dir, ns.checkpoint)
        if ns.out.exists() and (not ns.out.is_dir() or any(ns.out.iterdir())):
            raise UsageError(f"{ns.out} exists and is not an empty directory; choose a new output directory")
        problem = unwritable_output(ns.out, "OUT")
        if problem:
            raise UsageError(problem)

        with distributed_session():
            run = load_run(ns.run_dir, device="cpu", checkpoint=ns.checkpoint)
            path = export_hf(run, ns.out)
    except UsageError as err:
        return fail(PROG, str(err))
    except OSError as err:  # a full disk, or permissions that changed while exporting
        message = write_failure_message(err, ns.out, "OUT")
        if message is None:
            raise
        # export_hf writes into OUT.tmp and renames it to OUT only when complete
        shutil.rmtree(ns.out.with_name(ns.out.name + ".tmp"), ignore_errors=True)
        return fail(PROG, message)
    print(f"exported checkpoint {run.iteration} of {ns.run_dir} to {path}")
    if architecture == DMOE_GPT:
        print(f"no stock transformers architecture computes this model ({why_not_stock(run.cfg)}): it is "
              f"{ARCHITECTURE} with {MODELING_FILE.name}; load it with "
              "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)")
    return 0


def main() -> None:
    sys.exit(export_main())


if __name__ == "__main__":
    main()
