"""Megatron-LM's flags that have no key of the same name here: the ones accepted with no effect, the
ones whose values translate into a key of ours, and the ones refused with what to use instead.

Together with config/megatron_names.py (the flags that are one of our keys) this covers what the
argument parser of Megatron-LM's pretrain_gpt.py takes in a GPT MoE launch script
(examples/mixtral/train_mixtral_8x7b_distributed.sh and the MoE guide's scripts); the README's
"Megatron-LM flags" table lists them by group.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

# Accepted and ignored: each selects a fusion or an implementation this package replaces with its
# own, or switches on what a key here already says. name -> whether the flag takes a value.
NO_OPS: Dict[str, bool] = {
    "use_mcore_models": False,  # always megatron-core's GPTModel
    "use_legacy_models": False,
    "no_masked_softmax_fusion": False,  # attention is torch's SDPA
    "attention_softmax_in_fp32": False,
    "use_flash_attn": False,
    "attention_backend": True,
    "no_bias_gelu_fusion": False,  # our fused linears and activations
    "no_bias_swiglu_fusion": False,
    "no_bias_dropout_fusion": False,
    "no_rope_fusion": False,
    "no_gradient_accumulation_fusion": False,
    "no_persist_layer_norm": False,
    "no_create_attention_mask_in_dataloader": False,  # causal attention needs no mask
    "group_query_attention": False,  # model.num_query_groups alone decides
    "moe_grouped_gemm": False,  # the experts are our block-sparse kernels (moe.backend)
    "moe_use_legacy_grouped_gemm": False,
    "moe_token_dispatcher_type": True,  # the dispatch is ours (moe.ep_exchange)
    "moe_enable_deepep": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,  # moe.router_impl
    "moe_shared_expert_overlap": False,  # the shared MLP runs beside the exchange anyway
    "moe_per_layer_logging": False,  # metrics.jsonl and TensorBoard always log per layer
    "accumulate_allreduce_grads_in_fp32": False,  # gradients are always reduced in fp32
    "distributed_backend": True,  # NCCL on GPUs, gloo on CPUs
    "log_throughput": False,  # always logged
    "log_timers_to_tensorboard": False,
    "log_validation_ppl_to_tensorboard": False,
    "log_memory_to_tensorboard": False,
    "timing_log_level": True,
}

# Flags whose values translate: flag -> {value: (key, value) to set, or None: accepted as it is}; a
# value missing here is refused with REFUSED_VALUES' reason. --no-position-embedding is accepted
# with RoPE only (it drops the learned position embedding, which RoPE runs never have).
VALUE_MAPS: Dict[str, Dict[str, Optional[Tuple[str, str]]]] = {
    # megatron-core's balancing names; none switches the load-balancing loss off whatever
    # --moe-aux-loss-coeff says (applied after every other flag)
    "moe_router_load_balancing_type": {"aux_loss": ("moe.aux_loss_type", "micro_batch"),
                                       "seq_aux_loss": ("moe.aux_loss_type", "sequence"),
                                       "global_aux_loss": ("moe.aux_loss_type", "global"),
                                       "none": ("moe.aux_loss_coeff", "0")},
    "optimizer": {"adam": None},
    "ckpt_format": {"torch_dist": None},
    # fp8 is DeepSeek-V3's block-scaled e4m3 recipe here (training.fp8: blockwise), without Transformer Engine
    "fp8_format": {"e4m3": ("training.fp8", "blockwise")},
    "fp8_recipe": {"blockwise": None},
}
REFUSED_VALUES: Dict[str, str] = {
    "moe_router_load_balancing_type": "sinkhorn balancing is not implemented here; use aux_loss, seq_aux_loss, "
                                      "global_aux_loss or none",
    "optimizer": "only Adam (AdamW, decoupled weight decay) trains here; use --optimizer adam or leave it out",
    "ckpt_format": "checkpoints are torch_dist here (megatron-core's distributed format); use --ckpt-format "
                   "torch_dist or leave it out",
    "fp8_format": "fp8 here is e4m3 throughout, gradients included, with block scales (DeepSeek-V3's recipe); "
                  "use --fp8-format e4m3 --fp8-recipe blockwise, or --bf16",
    "fp8_recipe": "fp8 here scales 1 x 128 tiles of activations and gradients and 128 x 128 blocks of weights; "
                  "use --fp8-recipe blockwise (with --fp8-format e4m3), or --bf16",
}

# Refused: flag -> (why, what to use instead). Each is one line of its own.
REFUSED: Dict[str, Tuple[str, str]] = {
    "lr_warmup_fraction": ("the warmup is counted in steps here", "use --lr-warmup-iters"),
    "train_samples": ("runs are counted in steps here", "use --train-iters"),
    "lr_decay_samples": ("the schedule is counted in steps here", "use --lr-decay-iters"),
    "lr_warmup_samples": ("the schedule is counted in steps here", "use --lr-warmup-iters"),
    "recompute_method": ("full recompute here recomputes every layer, one at a time (uniform, 1 layer)",
                         "leave --recompute-method and --recompute-num-layers out"),
    "recompute_num_layers": ("full recompute here recomputes every layer, one at a time (uniform, 1 layer)",
                             "leave --recompute-method and --recompute-num-layers out"),
    "moe_layer_recompute": ("MoE layers are not recomputed whole here",
                            "use moe.memory_optimized=true (recomputes the experts' activation) or "
                            "--recompute-granularity"),
    "exit_duration_in_mins": ("its clock counts start-up too",
                              "use training.time_limit_minutes=M (minutes of training steps; saves and exits)"),
    "mock_data": ("random tokens train nothing worth checking",
                  "leave --data-path out: the built-in corpus trains without downloads"),
    "moe_pad_expert_input_to_capacity": ("token dropping here never pads the experts' inputs to capacity",
                                         "leave it out (--moe-expert-capacity-factor alone drops tokens)"),
    "moe_use_upcycling": ("upcycling reads a dense run of this package",
                          "use checkpoint.upcycle_from=DENSE_RUN_DIR (with --moe-upcycling-granularity)"),
    "moe_router_topk_limited_devices": ("device-limited routing is group-limited routing here",
                                        "use --moe-router-num-groups with --moe-router-group-topk"),
    "moe_extended_tp": ("experts are split over ranks by expert tensor parallelism here",
                        "use --expert-tensor-parallel-size"),
    "num_layers_per_virtual_pipeline_stage": ("virtual stages are counted per pipeline rank here",
                                              "use parallel.virtual_pipeline_model_parallel_size=V (model "
                                              "chunks per pipeline rank)"),
    "use_torch_fsdp2": ("FSDP is not supported", "use --use-distributed-optimizer (sharded optimizer state)"),
    "use_megatron_fsdp": ("FSDP is not supported", "use --use-distributed-optimizer (sharded optimizer state)"),
    "apply_layernorm_1p": ("zero-centred norm weights are not supported", "leave it out (plain LayerNorm/RMSNorm)"),
    "rotary_seq_len_interpolation_factor": ("RoPE scaling is not supported", "leave it out"),
    "use_rope_scaling": ("RoPE scaling is not supported", "leave it out"),
    "use_checkpoint_args": ("a run's settings come from its config.yaml", "use --load with the run directory "
                            "(--resume), which reads them"),
    "spec": ("dmoe-train always builds its own dMoE layer spec", "leave it out (--spec is for Megatron-LM's "
             "pretrain_gpt.py, README: Using the layer from Megatron-LM)"),
    "start_weight_decay": ("weight decay is constant here", "use --weight-decay"),
    "end_weight_decay": ("weight decay is constant here", "use --weight-decay"),
    "weight_decay_incr_style": ("weight decay is constant here", "use --weight-decay"),
}
# refused flags that take a value (the others are switches)
REFUSED_SWITCHES = {"mock_data", "moe_layer_recompute", "moe_pad_expert_input_to_capacity", "moe_use_upcycling",
                    "moe_extended_tp", "use_torch_fsdp2", "use_megatron_fsdp", "apply_layernorm_1p",
                    "use_rope_scaling", "use_checkpoint_args"}


def refusal(flag: str, name: str) -> str:
    why, instead = REFUSED[name]
    return f"{flag} is not supported: {why}; {instead}"
