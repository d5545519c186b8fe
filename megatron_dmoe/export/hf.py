"""Write a loaded run as a transformers model directory: config.json, model.safetensors,
generation_config.json and the tokenizer files, and for DmoeGptForCausalLM its modeling file (see
hf_architecture.py for which architecture a model gets)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_dmoe.export import deepseek, deepseek_weights
from megatron_dmoe.export.dmoe_gpt import copy_modeling_file, dmoe_gpt_config
from megatron_dmoe.export.gpt2 import gpt2_config, gpt2_weights
from megatron_dmoe.export.hf_architecture import DMOE_GPT, GPT2, hf_architecture
from megatron_dmoe.export.hf_families import BY_KEY, hf_config
from megatron_dmoe.export.hf_weights import to_hf
from megatron_dmoe.export.tokenizer_files import (
    check_exportable_tokenizer,
    copy_tokenizer_folder,
    hf_tokenizer_folder,
    write_tokenizer_files,
)
from megatron_dmoe.export.weights import model_state
from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.inference.run_model import LoadedRun, unwrapped

DEEPSEEK_KEYS = {f.key: f for f in deepseek.DEEPSEEK_FAMILIES}
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def check_hf_export(run: LoadedRun) -> str:
    """The architecture, after every check that needs no writing; raises UsageError."""
    arch = hf_architecture(run.cfg)
    if hf_tokenizer_folder(run.cfg) is None:
        check_exportable_tokenizer(run.tokenizer)
    check_safetensors()
    return arch


def check_safetensors() -> None:
    """Raise UsageError (one line naming the extra) when safetensors cannot be imported."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise UsageError("--format hf writes model.safetensors and needs the safetensors package: "
                         "pip install 'megatron-dmoe[hf]' (or safetensors)") from None


def export_hf(run: LoadedRun, out: Path) -> Path:
    """Write `run`'s model into the directory `out` (created; must not hold files yet)."""
    arch = check_hf_export(run)
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory; choose a new output directory")
    model = unwrapped(run.model)
    tc = model.config
    state = model_state(model)
    vocab = state["embedding.word_embeddings.weight"].shape[0]  # padded, as the logits
    tok = run.tokenizer
    if arch == GPT2:
        config = gpt2_config(run.cfg, tc, vocab, tok.eod)
        tensors = gpt2_weights(state, run.cfg)
    elif arch in DEEPSEEK_KEYS:
        config = deepseek.hf_config(DEEPSEEK_KEYS[arch], run.cfg, vocab, tok.eod, _bos(tok))
        tensors = deepseek_weights.to_hf(state, run.cfg.model, run.cfg.moe)
    elif arch == DMOE_GPT:
        config = dmoe_gpt_config(run.cfg, tc, vocab, tok.eod, _bos(tok))
        tensors = state  # the modeling file's names are megatron-core's
    else:
        family = BY_KEY[arch]
        config = hf_config(family, run.cfg, tc, vocab, tok.eod, _bos(tok))
        tensors = to_hf(state, family, run.cfg.model, tc.kv_channels)
    dtype = _DTYPES[str(state["embedding.word_embeddings.weight"].dtype)]
    config["torch_dtype"] = dtype
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # safetensors stores each tensor's own bytes: no views into larger tensors, no shared storage
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(staging / "model.safetensors"),
              metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copymode(staging / "config.json", staging / "model.safetensors")  # safetensors writes 0600
    if arch == DMOE_GPT:
        copy_modeling_file(staging)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": tok.eod}
    if vocab > run.vocab_size:  # the rows padding added hold no token: generation never picks them, as ours
        generation["suppress_tokens"] = list(range(run.vocab_size, vocab))
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    folder = hf_tokenizer_folder(run.cfg)
    if folder is not None:
        copy_tokenizer_folder(folder, staging)
    else:
        write_tokenizer_files(tok, staging, run.cfg.model.max_position_embeddings)
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return out


def _bos(tokenizer) -> int:
    try:
        return tokenizer.bos
    except NotImplementedError:
        return tokenizer.eod
