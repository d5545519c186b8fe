"""dmoe-import: a transformers model directory as a run directory to continue training."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.inference.cli_common import fail

PROG = "dmoe-import"
DESCRIPTION = """\
Turn a transformers model directory (config.json, *.safetensors, tokenizer files) of
MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM,
DeepseekV2ForCausalLM, DeepseekV3ForCausalLM or the dense LlamaForCausalLM and Qwen3ForCausalLM
into a run directory: the resolved config.yaml, the checkpoint of step 0 (the model's weights, a
fresh optimizer and learning-rate schedule) and the tokenizer (RUN_DIR/tokenizer). Then:

  dmoe-generate RUN_DIR                        generate
  dmoe-eval RUN_DIR [--data-path PREFIX]       evaluate (on given data, for a run without data)
  dmoe-export RUN_DIR OUT                      back to the same transformers architecture
  dmoe-train --run-dir RUN_DIR --resume        fine-tune (any layout: parallel.* overrides; a run
                                               imported without data takes data.data_path=PREFIX)

The model's settings come from config.json (shapes, norms and their epsilon, query/key norm, RoPE
theta, grouped-query attention, routing with or without renormalisation, Qwen2-MoE's gated shared
expert and query/key/value biases; DeepSeek's multi-latent attention, YaRN, dense first layers,
shared experts, group-limited routing and selection bias); a field with no equivalent here (sliding
windows, other biases, clipped queries and keys, other RoPE scaling, dense layers between the MoE
layers) is refused before anything is written. A dense import upcycles into a dMoE: dmoe-train
RUN_DIR/config.yaml --run-dir NEW checkpoint.upcycle_from=RUN_DIR moe.num_experts=N ... Everything
else is chosen with key=value overrides as for dmoe-train, here, because a resumed run keeps them:
the data (data.data_path: tokenized with this model's tokenizer; without it, the run has no data
until it is trained), the schedule (training.lr, training.train_iters, ...), the precision
(training.bf16) and the MoE backend. The schedule starts from fine-tuning defaults, printed when not set:
training.lr=1e-05, training.min_lr=1e-06, training.lr_warmup_iters=20 and model.seq_length =
max_position_embeddings up to 4096. Runs in one process.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="the transformers model directory to read")
    parser.add_argument("--run-dir", type=Path, required=True, metavar="RUN_DIR",
                        help="the run directory to create (new, or without a previous run's files)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as for dmoe-train (data.data_path=PREFIX: the data to fine-tune on)")
    return parser


def import_main(argv: Optional[List[str]] = None) -> int:
    ns = _parser().parse_intermixed_args(argv)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return fail(PROG, "run dmoe-import as one process (not under torchrun); train the run at any layout after")
    from megatron_dmoe.console import held_warnings, show_warnings_plainly
    from megatron_dmoe.data import DataError
    from megatron_dmoe.hf_import.plan import plan_import
    from megatron_dmoe.hf_import.write_run import write_run
    from megatron_dmoe.inference.errors import UsageError
    from megatron_dmoe.inference.no_data import has_no_data
    from megatron_dmoe.training.checkpoint import CheckpointError
    from megatron_dmoe.training.run_dir import RunDirError

    show_warnings_plainly(PROG)
    try:
        with held_warnings():  # the config's warnings once every check has passed
            plan = plan_import(ns.hf_dir, ns.run_dir, ns.overrides)  # every check; nothing written
        if plan.chosen:
            print(f"fine-tuning defaults: {' '.join(plan.chosen)} (set any of them as key=value)", flush=True)
        path = write_run(plan)
    except (UsageError, DataError, CheckpointError, RunDirError) as err:
        return fail(PROG, str(err))
    data = " data.data_path=PREFIX" if has_no_data(plan.cfg) else ""
    print(f"imported {ns.hf_dir} ({plan.family.architecture}) into {ns.run_dir} as {path.name}; "
          f"fine-tune with: dmoe-train --run-dir {ns.run_dir} --resume{data}")
    return 0


def main() -> None:
    sys.exit(import_main())


if __name__ == "__main__":
    main()
