"""The one place that knows which megatron-core release is installed (0.16 through 0.19).

Everything else asks here instead of checking versions itself. Each answer names what differs in
terms of megatron-core's own objects (where a function is looked up, what a class is called), so
callers patch or call the right thing without knowing release numbers.
"""
from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import List, Optional, Tuple

SUPPORTED = ((0, 16), (0, 19))  # oldest and newest minor release tested


@functools.lru_cache(maxsize=None)
def version() -> Tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int(minor)


# --- dist_checkpointing's torch_dist save -------------------------------------------------------

def checkpoint_writer_homes() -> List[ModuleType]:
    """The modules whose `FileSystemWriterAsync` the torch_dist save strategy instantiates.

    0.16's strategy module imports the class by name; 0.19 looks it up in filesystem_async at each
    save. Patching the name in every module that holds it covers both.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async, torch as torch_strategy

    return [m for m in (torch_strategy, filesystem_async) if hasattr(m, "FileSystemWriterAsync")]


def checkpoint_finalize_homes() -> List[ModuleType]:
    """The modules whose `save_state_dict_async_finalize` a torch_dist save calls at its end
    (0.16: imported by name into the strategy module; 0.19: looked up in state_dict_saver)."""
    from megatron.core.dist_checkpointing.strategies import state_dict_saver, torch as torch_strategy

    return [m for m in (torch_strategy, state_dict_saver) if hasattr(m, "save_state_dict_async_finalize")]


def write_results_queue_name() -> str:
    """The filesystem_async function that makes the writer's results queue (a Manager's queue)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in ("get_write_results_queue", "_get_write_results_queue"):
        if hasattr(filesystem_async, name):
            return name
    raise AttributeError("megatron-core's filesystem_async has no write-results queue factory")


# --- notices that say nothing a user of this project can act on -----------------------------------

# logger name -> start of the message. 0.19 deprecates GPTModel (in favour of HybridModel) and its
# own synchronous checkpoint save, which dist_checkpointing.save itself goes through; its
# tensor_parallel imports torch's cpp_extension, which on a CPU machine with a CUDA toolkit says so.
_NOTICES = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


# megatron-core warns at import, four times, that Transformer Engine and apex are not installed (and
# its layer specs that apex is not): both are optional here and nothing needs them
_IMPORT_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed")


class _DropNotice:
    def __init__(self, start: str):
        self.start = start

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_notices() -> None:
    """Drop megatron-core's release notices and import-time warnings listed above (idempotent; needs
    no megatron import: call it before megatron-core is first imported, wherever that happens)."""
    import logging
    import warnings

    for name, start in _NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(start))
    for message in _IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def checkpoint_format_problem(path) -> Optional[str]:
    """Why this megatron-core cannot read the checkpoint folder `path`, or None.

    megatron-core 0.19 keeps a checkpoint's common (non-sharded) state inside the torch_dist files
    and reads 0.16's separate common.pt as well; 0.16 through 0.18 know only common.pt.
    """
    from pathlib import Path

    if version() >= (0, 19) or (Path(path) / "common.pt").exists():
        return None
    installed = ".".join(map(str, version()))
    return (f"{path} was written with megatron-core 0.19 or newer (no common.pt), which megatron-core "
            f"{installed} cannot read; load it with megatron-core 0.19 (see the README's megatron-core versions)")


# --- layer specs ---------------------------------------------------------------------------------

def mlp_spec_submodules(mlp_spec):
    """The MLPSubmodules of a layer spec's `mlp` entry, or None when it has none (an MoE layer).

    0.16 gives the dense MLP as a ModuleSpec(module=MLP, submodules=...); 0.19 as
    functools.partial(MLP.as_mlp_submodule, submodules=...).
    """
    if isinstance(mlp_spec, functools.partial):
        submodules = mlp_spec.keywords.get("submodules")
    else:
        submodules = getattr(mlp_spec, "submodules", None)
    return submodules if hasattr(submodules, "linear_fc1") else None


def with_mlp_spec_submodules(mlp_spec, submodules):
    """`mlp_spec` (either form above) with its MLPSubmodules replaced by `submodules`."""
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(mlp_spec.func, *mlp_spec.args, **{**mlp_spec.keywords, "submodules": submodules})
    return dataclasses.replace(mlp_spec, submodules=submodules)


def local_mla_self_attention():
    """megatron-core's MLASelfAttention as the local layer spec builds it, without Transformer Engine:
    0.16's class; from 0.19 compat/mla_query_projection.py's (see there why)."""
    if version() < (0, 19):
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        return MLASelfAttention
    from megatron_dmoe.compat.mla_query_projection import PlainQueryProjectionMLA

    return PlainQueryProjectionMLA


# --- tokenizers ----------------------------------------------------------------------------------

def build_megatron_tokenizer(args):
    """megatron-core's build_tokenizer, given Megatron-LM's arguments under 0.16's names
    (tokenizer_special_tokens, tokenizer_hf_use_fast, tokenizer_hf_include_special_tokens,
    tokenizer_metadata, ...).

    0.19 moved the function to tokenizers.utils and reads some of these under new names (negated
    flags for the Hugging Face ones) plus a few new ones; they get the values that build the same
    tokenizer as 0.16 (its library defaults, and no vocabulary padding: the model pads its own).
    0.19's NullTokenizer counts its end-of-document id inside vocab_size (0.16: ids 0..vocab_size-1
    and eod = vocab_size): it gets one more, so both give ids 0..vocab_size and eod = vocab_size.
    """
    if version() < (0, 19):
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

        return build_tokenizer(args)
    from types import SimpleNamespace

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    null = args.tokenizer_type == "NullTokenizer" and args.vocab_size
    return build_tokenizer(SimpleNamespace(
        **{**vars(args), "vocab_size": args.vocab_size + 1 if null else args.vocab_size},
        special_tokens=args.tokenizer_special_tokens,
        tokenizer_hf_no_use_fast=not args.tokenizer_hf_use_fast,
        tokenizer_hf_no_include_special_tokens=not args.tokenizer_hf_include_special_tokens,
        metadata_path=args.tokenizer_metadata,
        chat_template=None,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True,  # the library's default, as 0.16 left it
        pad_vocab_size=False,
    ))


# --- the MoE aux-loss tracker Megatron-LM logs ------------------------------------------------------

def _metrics_tracker():
    """0.19's MoEMetricsTracker, or None where the tracker is 0.16's plain dict."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return None
    return get_moe_metrics_tracker()


def aux_loss_tracker_values() -> dict:
    """name -> the per-layer tensor megatron-core's aux-loss tracker accumulates (the tensors
    themselves, not copies). 0.19 keeps them in MoEMetricsTracker entries, and its deprecated
    get_moe_layer_wise_logging_tracker returns a new dict on each call."""
    tracker = _metrics_tracker()
    if tracker is not None:
        return {name: entry.values for name, entry in tracker.metrics.items()}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}


def drop_aux_loss_tracker_entry(name: str) -> None:
    """Remove one metric from megatron-core's aux-loss tracker (the next record recreates it)."""
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.metrics.pop(name, None)
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().pop(name, None)


def clear_aux_loss_tracker() -> None:
    """Empty megatron-core's aux-loss tracker (0.19 deprecates clear_aux_losses_tracker)."""
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
