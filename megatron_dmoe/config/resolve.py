"""Fill the keys whose default depends on other keys (the `None = ...` comments of the schema)."""
from __future__ import annotations

import copy

from .schema import RunConfig

# Each derived key and the keys its default is computed from (validation skips checks on a derived
# value when one of its sources is itself invalid, so one mistake is reported once).
DERIVED_FROM = {
    "model.ffn_hidden_size": ("model.hidden_size",),
    "model.max_position_embeddings": ("model.seq_length",),
    "model.num_query_groups": ("model.num_attention_heads",),
    "model.rope_type": ("model.multi_latent_attention",),
    "moe.ffn_hidden_size": ("model.ffn_hidden_size", "model.hidden_size"),
    "moe.router_renormalize": ("moe.router_score_function", "moe.top_k", "moe.router_pre_softmax"),
    "training.lr_decay_iters": ("training.train_iters",),
}


def default_router_renormalize(score_function: str, top_k: int, pre_softmax: bool) -> bool:
    """Sigmoid scores are independent per expert: rescale several picks to sum 1, never one (it
    would become the constant 1). Softmax after top-k already sums to 1 (renormalising is
    harmless); softmax over all experts first keeps the raw probabilities, as Megatron does."""
    if score_function == "sigmoid":
        return top_k > 1
    return not pre_softmax


def _get(cfg: RunConfig, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _set(cfg: RunConfig, dotted: str, value) -> None:
    section, key = dotted.split(".")
    setattr(getattr(cfg, section), key, value)


def resolve(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with every derived default filled in; explicit values are kept.

    The keys filled in are recorded in ``derived``; the keys already recorded there (a run's
    config.yaml lists them) are derived again from their sources' current values, so a resumed run
    whose training.train_iters changed decays its learning rate over the new length.
    model.vocab_size stays None when unset: the tokenizer decides it when the data is built.
    A virtual pipeline size of 1 becomes None (no interleaving).
    Resolving a resolved config changes nothing.
    """
    out = copy.deepcopy(cfg)
    for dotted in cfg.derived:
        if dotted in DERIVED_FROM:
            _set(out, dotted, None)
    out.derived = tuple(dotted for dotted in DERIVED_FROM if _get(out, dotted) is None)
    model, moe, training = out.model, out.moe, out.training
    if model.ffn_hidden_size is None:
        model.ffn_hidden_size = 4 * model.hidden_size  # for swiglu too, as Megatron's default
    if model.max_position_embeddings is None:
        model.max_position_embeddings = model.seq_length
    if model.num_query_groups is None:
        model.num_query_groups = model.num_attention_heads
    if model.rope_type is None:
        model.rope_type = "yarn" if model.multi_latent_attention else "rope"  # Megatron-LM's defaults
    if moe.ffn_hidden_size is None:
        moe.ffn_hidden_size = model.ffn_hidden_size
    if moe.router_renormalize is None:
        moe.router_renormalize = default_router_renormalize(
            moe.router_score_function, moe.top_k, moe.router_pre_softmax)
    if training.lr_decay_iters is None:
        training.lr_decay_iters = training.train_iters
    if out.parallel.virtual_pipeline_model_parallel_size == 1:
        # one model chunk per pipeline rank is no interleaving, as in Megatron-LM; megatron-core's
        # interleaved schedule given a single chunk stops in its first step
        out.parallel.virtual_pipeline_model_parallel_size = None
    return out
