"""Everything dmoe-import checks before it writes anything: the model directory's config.json,
weights and tokenizer files, the user's overrides, the resolved and validated run config, and the
run directory. Each refusal is one line (UsageError). Without data.data_path the run is one without
data (inference/no_data.py): generated from, evaluated on given data and exported, and given its
data when it is trained."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List

from megatron_dmoe.config import ConfigError, RunConfig, load_config, resolve
from megatron_dmoe.export import deepseek_weights
from megatron_dmoe.export.deepseek import DEEPSEEK_FAMILIES
from megatron_dmoe.export.hf_families import Family
from megatron_dmoe.export.hf_weights import OUTPUT, hf_names
from megatron_dmoe.export.tokenizer_files import HF_TOKENIZER_FILES
from megatron_dmoe.hf_import.fine_tuning import fine_tuning_defaults
from megatron_dmoe.hf_import.hf_config import family_of, model_keys, read_hf_config
from megatron_dmoe.hf_import.safetensors_files import SafetensorsFiles
from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.inference.no_data import validate_without_data

TOKENIZER_DIR = "tokenizer"  # the run directory's copy of the model's tokenizer files
# keys dmoe-import sets for the tokenizer it copies
TOKENIZER_KEYS = ("data.tokenizer_type", "data.tokenizer_model", "data.vocab_file", "data.merge_file")


@dataclass
class ImportPlan:
    hf_dir: Path
    run_dir: Path
    family: Family
    cfg: RunConfig  # resolved and validated
    files: SafetensorsFiles
    tokenizer_files: List[str]
    chosen: List[str]  # the fine-tuning defaults (fine_tuning.py) the user left, as key=value


def _user_keys(overrides: List[str]) -> List[str]:
    keys = []
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"{item!r} is not a key=value override (e.g. data.data_path=PREFIX "
                             "training.train_iters=1000)")
        keys.append(item.split("=", 1)[0].strip())
    return keys


def plan_import(hf_dir: Path, run_dir: Path, overrides: List[str]) -> ImportPlan:
    from megatron_dmoe.training.run_dir import previous_run_files, unwritable_run_dir

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config = read_hf_config(hf_dir)
    path = hf_dir / "config.json"
    family = family_of(config, path)
    fixed, defaults = model_keys(config, family, path)

    tokenizer_files = [name for name in HF_TOKENIZER_FILES if (hf_dir / name).is_file()]
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(tokenizer_files):
        raise UsageError(f"{hf_dir} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json): "
                         "save the tokenizer with the model (tokenizer.save_pretrained)")

    fixed_keys = {item.split("=", 1)[0] for item in fixed}
    for key in _user_keys(overrides):
        if key in fixed_keys:
            raise UsageError(f"{key} is read from {path}; leave it out (choose the data, the schedule, the "
                             "precision and the MoE backend here; the layout when training)")
        if key in TOKENIZER_KEYS:
            raise UsageError(f"{key}: the run uses {hf_dir}'s tokenizer (copied into RUN_DIR/{TOKENIZER_DIR}); "
                             "leave it out")
    if "training.use_distributed_optimizer" in _user_keys(overrides):
        raise UsageError("training.use_distributed_optimizer: the imported checkpoint is written with the plain "
                         "optimizer; switch it on when training (dmoe-train --run-dir RUN_DIR --resume "
                         "training.use_distributed_optimizer=true)")

    previous = previous_run_files(run_dir)
    if previous or (run_dir / TOKENIZER_DIR).exists():
        held = ", ".join(previous) or TOKENIZER_DIR
        raise UsageError(f"--run-dir {run_dir} already holds {held}; choose a new run directory")
    problem = unwritable_run_dir(run_dir)
    if problem:
        raise UsageError(problem)

    tokenizer = ["data.tokenizer_type=HuggingFaceTokenizer",
                 f"data.tokenizer_model={(run_dir / TOKENIZER_DIR).absolute()}"]
    user_keys = set(_user_keys(overrides))
    starting = fine_tuning_defaults(config.get("max_position_embeddings", 4096))
    chosen = [f"{key}={value}" for key, value in starting.items() if key not in user_keys]
    try:
        cfg = resolve(load_config(None, defaults + chosen + list(overrides) + fixed + tokenizer))
        validate_without_data(cfg, world_size=1)
    except ConfigError as err:
        raise UsageError(str(err)) from None

    files = SafetensorsFiles(hf_dir)
    m = cfg.model
    untied = m.untie_embeddings_and_output_weights
    ignored = [] if untied else [OUTPUT[1]]
    if family in DEEPSEEK_FAMILIES:
        names = deepseek_weights.hf_names(m, cfg.moe, untied)
        ignored += deepseek_weights.prediction_layer_names(files.where, m.num_layers,
                                                           config.get("num_nextn_predict_layers") or 0)
    else:
        names = hf_names(family, m.num_layers, cfg.moe.num_experts, untied, m.add_qkv_bias)
    files.check_names(names, family.architecture, ignored=ignored)
    return ImportPlan(hf_dir=hf_dir, run_dir=run_dir, family=family, cfg=cfg, files=files,
                      tokenizer_files=tokenizer_files, chosen=chosen)
