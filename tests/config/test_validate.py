"""validate(): every rule reports its key, the value and what is allowed; all problems at once."""
import inspect
import pickle
import re
import typing

import pytest

from megatron_dmoe.config import (
    ConfigError,
    ConfigWarning,
    Environment,
    find_problems,
    find_warnings,
    resolve,
    schema,
    validate,
)
from megatron_dmoe.config.fields import section_types
from megatron_dmoe.config.section_checks.values import CHOICES, RANGES

EVERYTHING = Environment(cuda=True, transformer_engine=True, apex=True)
BARE_CPU = Environment(cuda=False, transformer_engine=False, apex=False)
APEX_ONLY = Environment(cuda=True, transformer_engine=False, apex=True)
TP2 = {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True}

# (changes to tiny, world_size, machine, key of the one expected problem, fragments of its message)
CASES = {
    "top_k_above_experts": ({"moe.top_k": 9}, None, EVERYTHING, "moe.top_k",
                            ["9 is larger than moe.num_experts (8)", "use a value from 1 to 8"]),
    "hidden_not_divisible_by_heads": (
        {"model.hidden_size": 130}, None, EVERYTHING, "model.hidden_size",
        ["130 is not divisible by model.num_attention_heads (4)", "multiple of 4"]),
    "query_groups_not_dividing_heads": (
        {"model.num_query_groups": 3}, None, EVERYTHING, "model.num_query_groups",
        ["3 does not divide model.num_attention_heads (4)", "1, 2, 4"]),
    "heads_not_divisible_by_tp": (
        {**TP2, "model.hidden_size": 192, "model.num_attention_heads": 6,
         "parallel.tensor_model_parallel_size": 4}, None, EVERYTHING, "model.num_attention_heads",
        ["6 is not divisible by parallel.tensor_model_parallel_size (4)", "1, 2, 3, 6"]),
    "query_groups_not_divisible_by_tp": (
        {**TP2, "model.num_query_groups": 2, "parallel.tensor_model_parallel_size": 4}, None,
        EVERYTHING, "model.num_query_groups",
        ["2 is not divisible by parallel.tensor_model_parallel_size (4)", "among: 1, 2"]),
    "experts_not_divisible_by_ep": (
        {"parallel.expert_model_parallel_size": 3}, None, EVERYTHING, "moe.num_experts",
        ["8 is not divisible by parallel.expert_model_parallel_size (3)", "multiple of 3"]),
    "ep_neither_divisor_nor_multiple_of_experts": (
        {"parallel.expert_model_parallel_size": 12}, None, EVERYTHING, "moe.num_experts",
        ["8 is not divisible by parallel.expert_model_parallel_size (12)",
         "nor is 12 a multiple of it", "one of 1, 2, 3, 4, 6, 12"]),
    "ep_splits_ffn_unevenly": (
        {"parallel.expert_model_parallel_size": 16, "moe.backend": "grouped", "moe.ffn_hidden_size": 255},
        None, EVERYTHING, "moe.ffn_hidden_size",
        ["255 is not divisible by 2", "expert_model_parallel_size 16 / moe.num_experts 8",
         "multiple of 2"]),
    "sparse_ffn_shard_not_multiple_of_block": (
        {"parallel.expert_model_parallel_size": 32, "moe.backend": "sparse", "moe.block_size": 128},
        None, EVERYTHING, "moe.ffn_hidden_size",
        ["256 split over 4 ranks per expert", "shards of 64", "moe.block_size (128)",
         "multiple of 512"]),
    "capacity_factor_with_ep": (
        {"parallel.expert_model_parallel_size": 2, "moe.expert_capacity_factor": 1.5}, None,
        EVERYTHING, "moe.expert_capacity_factor",
        ["1.5 (the token-dropping baseline) runs on whole local experts", "set it to null"]),
    "capacity_factor_with_etp": (
        {**TP2, "parallel.expert_tensor_parallel_size": 2, "moe.expert_capacity_factor": 1.0}, 2,
        EVERYTHING, "moe.expert_capacity_factor",
        ["parallel.expert_tensor_parallel_size is 2", "set it to null"]),
    "etp_without_experts": (
        {**TP2, "moe.num_experts": 0, "parallel.expert_tensor_parallel_size": 2}, 2, EVERYTHING,
        "parallel.expert_tensor_parallel_size", ["needs MoE layers", "moe.num_experts is 0"]),
    "etp_ffn_not_divisible": (
        {**TP2, "parallel.expert_tensor_parallel_size": 2, "moe.ffn_hidden_size": 255}, 2, EVERYTHING,
        "moe.ffn_hidden_size", ["255 is not divisible by 2", "parallel.expert_tensor_parallel_size 2"]),
    "ep_without_experts": (
        {"moe.num_experts": 0, "parallel.expert_model_parallel_size": 2}, None, EVERYTHING,
        "parallel.expert_model_parallel_size", ["needs MoE layers", "moe.num_experts is 0"]),
    "top1_softmax_after_topk": (
        {"moe.top_k": 1, "moe.router_pre_softmax": False}, None, EVERYTHING,
        "moe.router_pre_softmax", ["every routing weight 1", "no gradient", "set it to true"]),
    "top1_renormalized": (
        {"moe.top_k": 1, "moe.router_renormalize": True}, None, EVERYTHING,
        "moe.router_renormalize", ["every routing weight 1", "use false or null"]),
    "top1_sigmoid_renormalized": (
        {"moe.top_k": 1, "moe.router_score_function": "sigmoid", "moe.router_renormalize": True},
        None, EVERYTHING, "moe.router_renormalize", ["no gradient"]),
    "bf16_and_fp16": ({"training.bf16": True, "training.fp16": True}, None, EVERYTHING,
                      "training.fp16", ["training.bf16", "choose one"]),
    "global_batch_vs_data_parallel": (
        {"training.global_batch_size": 24}, 2, EVERYTHING, "training.global_batch_size",
        ["24 is not divisible by training.micro_batch_size (8) x data-parallel size (2) = 16",
         "multiple of 16"]),
    "global_batch_vs_micro": (
        {"training.global_batch_size": 12}, None, EVERYTHING, "training.global_batch_size",
        ["12 is not divisible by training.micro_batch_size (8)", "multiple of 8"]),
    "world_not_divisible_by_tp_pp": (
        TP2, 3, EVERYTHING, "parallel.tensor_model_parallel_size",
        ["tensor (2) x pipeline (1) parallel size 2 does not divide the world size 3"]),
    "ep_not_dividing_stage_ranks": (
        {"parallel.expert_model_parallel_size": 4}, 2, EVERYTHING,
        "parallel.expert_model_parallel_size",
        ["4 does not divide the 2 ranks of a pipeline stage", "use one of: 1, 2"]),
    "ep_not_dividing_stage_ranks_with_pipeline": (
        {"parallel.expert_model_parallel_size": 4, "parallel.pipeline_model_parallel_size": 2,
         "training.global_batch_size": 32}, 4, EVERYTHING, "parallel.expert_model_parallel_size",
        ["4 does not divide the 2 ranks of a pipeline stage (world size 4 / pipeline 2",
         "use one of: 1, 2"]),
    "context_parallel": (
        {"parallel.context_parallel_size": 2}, 2, EVERYTHING, "parallel.context_parallel_size",
        ["context parallelism is not supported", "use 1"]),
    "etp_does_not_divide_the_stage": (
        {"parallel.expert_tensor_parallel_size": 2, "parallel.expert_model_parallel_size": 2}, 2, EVERYTHING,
        "parallel.expert_model_parallel_size", ["2 x parallel.expert_tensor_parallel_size (2) does not divide the 2 "
                                                "ranks"]),
    "dense_ffn_not_divisible_by_tp": (
        {**TP2, "moe.num_experts": 0, "model.ffn_hidden_size": 511}, 2, BARE_CPU,
        "model.ffn_hidden_size", ["511 is not divisible by parallel.tensor_model_parallel_size (2)",
                                  "multiple of 2"]),
    "layers_not_divisible_by_pp": (
        {"parallel.pipeline_model_parallel_size": 3}, None, EVERYTHING, "model.num_layers",
        ["2 is not divisible by parallel.pipeline_model_parallel_size (3)", "multiple of 3"]),
    "block_size_choice": ({"moe.block_size": 100}, None, EVERYTHING, "moe.block_size",
                          ["100 is not allowed", "use one of: 16, 32, 64, 128"]),
    "expert_bias_with_softmax": (  # megatron's TransformerConfig would refuse it after data preparation
        {"moe.router_enable_expert_bias": True}, None, EVERYTHING, "moe.router_enable_expert_bias",
        ["true needs moe.router_score_function: sigmoid", "it is 'softmax'"]),
    "grouped_bf16_unaligned_width": (
        {"moe.backend": "grouped", "moe.ffn_hidden_size": 260, "training.bf16": True}, None, EVERYTHING,
        "moe.ffn_hidden_size", ["not a multiple of 8", "moe.backend: grouped"]),
    "sparse_ffn_not_multiple_of_block": (
        {"moe.backend": "sparse", "moe.ffn_hidden_size": 200}, None, BARE_CPU,
        "moe.ffn_hidden_size",
        ["200 is not a multiple of moe.block_size (64)", "192 or 256", "moe.backend: grouped"]),
    "auto_backend_on_cuda_is_sparse": (
        {"moe.ffn_hidden_size": 40}, None, EVERYTHING, "moe.ffn_hidden_size",
        ["40 is not a multiple of moe.block_size (64)", "e.g. 64)"]),
    "derived_expert_width": (  # moe.ffn_hidden_size null = model.ffn_hidden_size
        {"moe.ffn_hidden_size": None, "model.ffn_hidden_size": 300, "moe.backend": "sparse"},
        None, EVERYTHING, "moe.ffn_hidden_size", ["300 is not a multiple of moe.block_size (64)"]),
    "capacity_factor_zero": ({"moe.expert_capacity_factor": 0.0}, None, EVERYTHING,
                             "moe.expert_capacity_factor", ["0.0 is out of range", "a number > 0"]),
    "capacity_factor_negative": ({"moe.expert_capacity_factor": -1.5}, None, EVERYTHING,
                                 "moe.expert_capacity_factor", ["-1.5 is out of range", "> 0"]),
    "decay_shorter_than_warmup": (
        {"training.lr_decay_iters": 10}, None, EVERYTHING, "training.lr_decay_iters",
        ["10 is not larger than training.lr_warmup_iters (20)", "use more than 20"]),
    "eval_without_iters": ({"training.eval_iters": 0}, None, EVERYTHING, "training.eval_iters",
                           ["would evaluate nothing", "at least 1", "eval_interval: 0"]),
    "seq_beyond_positions": (
        {"model.max_position_embeddings": 64}, None, EVERYTHING, "model.seq_length",
        ["128 is larger than model.max_position_embeddings (64)", "up to 64"]),
    "min_lr_above_lr": ({"training.min_lr": 0.01}, None, EVERYTHING, "training.min_lr",
                        ["0.01 is larger than training.lr (0.002)", "from 0 to 0.002"]),
    "lr_zero": ({"training.lr": 0.0}, None, EVERYTHING, "training.lr", ["a number > 0"]),
    "min_lr_negative": ({"training.min_lr": -1e-5}, None, EVERYTHING, "training.min_lr",
                        ["-1e-05 is out of range", ">= 0"]),
    "loss_scale_without_fp16": ({"training.loss_scale": 1024.0}, None, EVERYTHING,
                                "training.loss_scale", ["only with training.fp16: true"]),
    "hidden_dropout_one": ({"model.hidden_dropout": 1.0}, None, EVERYTHING, "model.hidden_dropout",
                           ["1.0 is out of range", "0 <= value < 1"]),
    "attention_dropout_negative": ({"model.attention_dropout": -0.1}, None, EVERYTHING,
                                   "model.attention_dropout", ["-0.1 is out of range"]),
    "zero_layers": ({"model.num_layers": 0}, None, EVERYTHING, "model.num_layers",
                    ["0 is out of range", "an integer >= 1"]),
    "negative_experts": ({"moe.num_experts": -8}, None, EVERYTHING, "moe.num_experts",
                         ["-8 is out of range", ">= 0"]),
    "zero_micro_batch": ({"training.micro_batch_size": 0}, None, EVERYTHING,
                         "training.micro_batch_size", [">= 1"]),
    "seed_negative": ({"training.seed": -1}, None, EVERYTHING, "training.seed",
                      ["0 <= value <= 4294967295"]),
    "beta2_one": ({"training.adam_beta2": 1.0}, None, EVERYTHING, "training.adam_beta2",
                  ["0 <= value < 1"]),
    "jitter_one": ({"moe.input_jitter_eps": 1.0}, None, EVERYTHING, "moe.input_jitter_eps",
                   ["0 <= value < 1"]),
    "save_interval_negative": ({"checkpoint.save_interval": -1}, None, EVERYTHING,
                               "checkpoint.save_interval", [">= 0"]),
    "peak_tflops_zero": ({"logging.peak_tflops": 0.0}, None, EVERYTHING, "logging.peak_tflops",
                         ["> 0"]),
    "decay_style_typo": ({"training.lr_decay_style": "cosin"}, None, EVERYTHING,
                         "training.lr_decay_style",
                         ["'cosin' is not allowed", "cosine, linear, constant",
                          "did you mean cosine?"]),
    "activation_choice": ({"model.activation": "relu"}, None, EVERYTHING, "model.activation",
                          ["'relu' is not allowed", "gelu, swiglu"]),
    "device_choice": ({"training.device": "gpu"}, None, EVERYTHING, "training.device",
                      ["'gpu' is not allowed", "auto, cpu, cuda"]),
    "recompute_choice": ({"training.recompute_granularity": "partial"}, None, EVERYTHING,
                         "training.recompute_granularity",
                         ["'partial' is not allowed", "null, full, selective"]),
    "progress_bar_choice": ({"logging.progress_bar": "yes"}, None, EVERYTHING,
                            "logging.progress_bar", ["auto, on, off"]),
    "sequence_parallel_without_tp": (
        {"parallel.sequence_parallel": True}, None, EVERYTHING, "parallel.sequence_parallel",
        ["needs parallel.tensor_model_parallel_size > 1", "set it to false"]),
    "moe_tp_without_sequence_parallel": (
        {"parallel.tensor_model_parallel_size": 2}, None, EVERYTHING, "parallel.sequence_parallel",
        ["MoE layers", "route the same tokens", "set it to true"]),
    "sequence_parallel_seq_length": (
        {**TP2, "model.hidden_size": 192, "model.num_attention_heads": 6,
         "parallel.tensor_model_parallel_size": 3}, None, EVERYTHING, "model.seq_length",
        ["128 is not divisible by parallel.tensor_model_parallel_size (3)", "multiple of 3"]),
    "virtual_pipeline_without_pipeline": (
        {"parallel.virtual_pipeline_model_parallel_size": 2, "model.num_layers": 4}, None, BARE_CPU,
        "parallel.virtual_pipeline_model_parallel_size",
        ["needs parallel.pipeline_model_parallel_size > 1", "set it to null"]),
    "virtual_pipeline_chunks_do_not_divide_layers": (
        {"model.num_layers": 4, "parallel.pipeline_model_parallel_size": 2,
         "parallel.virtual_pipeline_model_parallel_size": 3}, 2, BARE_CPU,
        "parallel.virtual_pipeline_model_parallel_size", ["6 model chunks do not divide model.num_layers (4)"]),
    "interleaved_micro_batches_not_a_multiple_of_pipeline": (
        {"model.num_layers": 4, "parallel.pipeline_model_parallel_size": 2,
         "parallel.virtual_pipeline_model_parallel_size": 2, "training.global_batch_size": 24}, 2, BARE_CPU,
        "training.global_batch_size", ["3 micro-batches per step", "use a multiple of 16"]),
    "transformer_engine_missing": (
        {"model.transformer_impl": "transformer_engine"}, None, BARE_CPU, "model.transformer_impl",
        ["cannot be imported", "use auto or local"]),
    "cuda_missing": ({"training.device": "cuda"}, None, BARE_CPU, "training.device",
                     ["CUDA is not available", "use auto or cpu"]),
    "bf16_without_cuda": (
        {"training.bf16": True}, None, BARE_CPU, "training.bf16", ["needs CUDA", "fp32"]),
    "fp16_on_cpu_device": (
        {"training.fp16": True, "training.device": "cpu"}, None, EVERYTHING, "training.fp16",
        ["needs CUDA", "set it to false"]),
    "symmetric_exchange_on_cpu": (
        {"moe.ep_exchange": "symmetric", "training.device": "cpu"}, None, EVERYTHING,
        "moe.ep_exchange", ["symmetric needs CUDA", "use auto or nccl"]),
    "nvshmem_exchange_on_cpu": (
        {"moe.ep_exchange": "nvshmem", "training.device": "cpu"}, None, EVERYTHING,
        "moe.ep_exchange", ["nvshmem needs CUDA", "use auto or nccl"]),
    "nvshmem_exchange_rows_torch_cannot_split": (
        {"moe.ep_exchange": "nvshmem", "parallel.expert_model_parallel_size": 2, "model.hidden_size": 72,
         "training.bf16": True}, 2, EVERYTHING,
        "moe.ep_exchange", ["rows of a multiple of 32 bytes", "group of 2", "144 bytes", "symmetric", "nccl"]),
    "unknown_exchange": (
        {"moe.ep_exchange": "shmem"}, None, EVERYTHING, "moe.ep_exchange", ["nccl", "symmetric", "nvshmem"]),
    "triton_cross_entropy_with_tensor_parallel": (
        {**TP2, "model.cross_entropy_fusion_impl": "triton"}, 2, EVERYTHING, "model.cross_entropy_fusion_impl",
        ["triton needs whole vocabulary rows", "parallel.tensor_model_parallel_size is 2", "use auto or native"]),
    "unknown_cross_entropy_impl": (
        {"model.cross_entropy_fusion_impl": "te"}, None, EVERYTHING, "model.cross_entropy_fusion_impl",
        ["auto", "triton", "native"]),
    "wgrad_per_step_with_grouped_experts": (
        {"moe.expert_wgrad_per_step": True, "moe.backend": "grouped"}, None, EVERYTHING,
        "moe.expert_wgrad_per_step", ["needs the sparse expert backend", "moe.backend is grouped",
                                      "set moe.backend: sparse"]),
    "wgrad_per_step_with_auto_experts_on_cpu": (
        {"moe.expert_wgrad_per_step": True}, None, BARE_CPU,
        "moe.expert_wgrad_per_step", ["moe.backend is auto (here: reference)"]),
    "wgrad_per_step_with_cuda_graphs": (
        {"moe.expert_wgrad_per_step": True, "training.cuda_graphs": True, "training.bf16": True}, None,
        EVERYTHING, "moe.expert_wgrad_per_step", ["no effect with training.cuda_graphs: true"]),
    "wgrad_window_with_grouped_experts": (
        {"moe.expert_wgrad_window": 2, "moe.backend": "grouped"}, None, EVERYTHING,
        "moe.expert_wgrad_window", ["2 needs the sparse expert backend", "set moe.backend: sparse"]),
    "wgrad_window_with_per_step": (
        {"moe.expert_wgrad_window": 2, "moe.expert_wgrad_per_step": True, "moe.backend": "sparse"}, None,
        EVERYTHING, "moe.expert_wgrad_window", ["both defer", "moe.expert_wgrad_per_step: false"]),
    "wgrad_window_not_dividing_the_micro_batches": (
        {"moe.expert_wgrad_window": 3, "training.global_batch_size": 16, "training.micro_batch_size": 2}, 2,
        EVERYTHING, "moe.expert_wgrad_window", ["3 does not divide the 4 micro-batches of a step",
                                                "data-parallel size 2", "use one of: 1, 2, 4"]),
    "wgrad_window_below_one": (
        {"moe.expert_wgrad_window": 0}, None, EVERYTHING, "moe.expert_wgrad_window", [">= 1"]),
    "cuda_graphs_on_cpu_device": (
        {"training.cuda_graphs": True, "training.device": "cpu"}, None, EVERYTHING,
        "training.cuda_graphs", ["needs CUDA", "training.device is cpu", "set it to false"]),
    "cuda_graphs_without_cuda": (
        {"training.cuda_graphs": True}, None, BARE_CPU, "training.cuda_graphs",
        ["needs CUDA, which is not available here"]),
    "cuda_graphs_with_nccl_expert_exchange": (
        {"training.cuda_graphs": True, "parallel.expert_model_parallel_size": 2, "moe.ep_exchange": "nccl"}, 2,
        EVERYTHING, "training.cuda_graphs", ["NCCL expert-parallel exchange", "expert_model_parallel_size = 2",
                                             "moe.ep_exchange: symmetric or auto", "set training.cuda_graphs: false"]),
    "cuda_graphs_with_recompute": (
        {"training.cuda_graphs": True, "training.recompute_granularity": "full"}, None, EVERYTHING,
        "training.cuda_graphs", ["activation recompute", "recompute_granularity: full", "moe.memory_optimized"]),
    "cuda_graphs_with_selective_recompute_and_attention_dropout": (
        {"training.cuda_graphs": True, "training.recompute_granularity": "selective",
         "model.transformer_impl": "local", "model.attention_dropout": 0.1}, None, EVERYTHING,
        "training.cuda_graphs", ["model.attention_dropout = 0.1", "set model.attention_dropout: 0"]),
    "cuda_graphs_with_reference_experts": (
        {"training.cuda_graphs": True, "moe.backend": "reference"}, None, EVERYTHING,
        "training.cuda_graphs", ["moe.backend: reference", "use sparse, grouped or auto"]),
    "data_path_without_weights": (
        {"data.data_path": ["a", "b"]}, None, EVERYTHING, "data.data_path",
        ["item 1 ('a') should be a weight", "[weight, prefix, weight, prefix, ...]"]),
    "data_path_odd": ({"data.data_path": ["0.3", "a", "0.7"]}, None, EVERYTHING, "data.data_path",
                      ["3 items", "pairs"]),
    "data_path_negative_weight": (
        {"data.data_path": ["-1", "a", "1", "b"]}, None, EVERYTHING, "data.data_path",
        ["weight -1 (item 1) must be positive"]),
    "data_path_weight_for_prefix": (
        {"data.data_path": ["0.5", "0.5"]}, None, EVERYTHING, "data.data_path",
        ["item 2 ('0.5') should be a path prefix"]),
    "data_path_empty_prefix": ({"data.data_path": [" "]}, None, EVERYTHING, "data.data_path",
                               ["the prefix is empty", "[prefix]"]),
    "split_two_parts": ({"data.split": "98,2"}, None, EVERYTHING, "data.split",
                        ["'98,2' is not three numbers", "'969,30,1'"]),
    "split_words": ({"data.split": "a,b,c"}, None, EVERYTHING, "data.split", ["not three numbers"]),
    "split_negative": ({"data.split": "100,-1,1"}, None, EVERYTHING, "data.split",
                       ["has a negative part", "non-negative"]),
    "split_zero": ({"data.split": "0,0,0"}, None, EVERYTHING, "data.split", ["sums to 0"]),
    "router_groups_not_dividing_experts": (
        {"moe.router_num_groups": 3, "moe.router_group_topk": 1}, None, EVERYTHING, "moe.router_num_groups",
        ["3 does not divide moe.num_experts (8)"]),
    "router_group_topk_alone": (
        {"moe.router_group_topk": 2}, None, EVERYTHING, "moe.router_num_groups",
        ["null while moe.router_group_topk is 2", "needs both"]),
    "router_group_topk_not_dividing_top_k": (
        {"moe.router_num_groups": 4, "moe.router_group_topk": 3}, None, EVERYTHING, "moe.router_group_topk",
        ["3 does not divide moe.top_k (2)"]),
    "shared_gate_without_shared_expert": (
        {"moe.shared_expert_gate": True}, None, EVERYTHING, "moe.shared_expert_gate",
        ["without a shared expert (moe.shared_expert_ffn_hidden_size is 0)"]),
    "router_impl_fused_with_groups": (
        {"moe.router_impl": "fused", "moe.router_num_groups": 4, "moe.router_group_topk": 2}, None, EVERYTHING,
        "moe.router_impl", ["fused cannot route with moe.router_num_groups 4", "use auto or torch"]),
    "router_impl_unknown": ({"moe.router_impl": "triton"}, None, EVERYTHING, "moe.router_impl",
                            ["'triton' is not allowed", "auto, fused, torch"]),
    "aux_loss_type_unknown": ({"moe.aux_loss_type": "batch"}, None, EVERYTHING, "moe.aux_loss_type",
                              ["'batch' is not allowed", "micro_batch, sequence, global"]),
    "first_dense_layers_all": ({"model.num_layers": 4, "moe.layer_freq": 2, "moe.first_dense_layers": 3}, None,
                               EVERYTHING, "moe.first_dense_layers",
                               ["3 leaves no MoE layer among the model's 4", "use at most 2"]),
    "first_dense_layers_negative": ({"moe.first_dense_layers": -1}, None, EVERYTHING, "moe.first_dense_layers",
                                    ["-1 is out of range", ">= 0"]),
    "upcycle_into_dense": (
        {"checkpoint.upcycle_from": "runs/dense", "moe.num_experts": 0}, None, EVERYTHING,
        "checkpoint.upcycle_from", ["needs MoE layers", "moe.num_experts is 0"]),
    "upcycle_expert_width": (
        {"checkpoint.upcycle_from": "runs/dense"}, None, EVERYTHING, "moe.ffn_hidden_size",
        ["256 is not model.ffn_hidden_size / moe.upcycle_granularity (512 / 1 = 512)",
         "moe.ffn_hidden_size: 512"]),
    "upcycle_granularity_experts": (
        {"checkpoint.upcycle_from": "runs/dense", "moe.upcycle_granularity": 4, "moe.num_experts": 6,
         "moe.ffn_hidden_size": 128}, None, EVERYTHING, "moe.upcycle_granularity",
        ["4 does not divide moe.num_experts (6)"]),
    "upcycle_granularity_without_upcycling": (
        {"moe.upcycle_granularity": 2}, None, EVERYTHING, "moe.upcycle_granularity",
        ["applies only to upcycling"]),
    "upcycle_and_load": (
        {"checkpoint.upcycle_from": "runs/dense", "checkpoint.load": "runs/x/checkpoints/iter_0000010",
         "moe.ffn_hidden_size": 512}, None, EVERYTHING, "checkpoint.upcycle_from",
        ["both initialise the weights"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_reports_its_key_and_hint(make, name):
    changes, world_size, env, key, fragments = CASES[name]
    cfg = make(changes)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size, env=env)
    problems = info.value.problems
    assert [k for k, _ in problems] == [key], problems  # exactly this one, no knock-on reports
    message = problems[0][1]
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert f"{key}: {message}" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).problems == problems  # crosses processes
    # The resolved config has the same one problem (validate resolves internally); only its key
    # may move to a derived key that resolve() made explicit.
    assert len(find_problems(resolve(cfg), world_size, env=env)) == 1


VALID = {
    "tiny": ({}, None, BARE_CPU),
    "tiny_on_two_processes": ({}, 2, BARE_CPU),
    "dense": ({"moe.num_experts": 0}, 1, BARE_CPU),
    "top1_pre_softmax": ({"moe.top_k": 1}, None, BARE_CPU),
    "top1_sigmoid": ({"moe.top_k": 1, "moe.router_score_function": "sigmoid"}, None, BARE_CPU),
    "expert_parallel": ({"parallel.expert_model_parallel_size": 2}, 2, BARE_CPU),
    "more_ep_ranks_than_experts": (
        {"parallel.expert_model_parallel_size": 4, "moe.num_experts": 2,
         "training.micro_batch_size": 4}, 4, BARE_CPU),
    "tp_with_apex": (TP2, 2, APEX_ONLY),
    "tp_on_bare_cpu": (TP2, 2, BARE_CPU),
    "dense_tp_without_sequence_parallel": (
        {"parallel.tensor_model_parallel_size": 2, "moe.num_experts": 0}, 2, BARE_CPU),
    "ep_folded_over_tp": ({**TP2, "parallel.expert_model_parallel_size": 2}, 2, BARE_CPU),
    "tp2_ep2_dp2_pp2": ({**TP2, "parallel.expert_model_parallel_size": 4,
                         "parallel.pipeline_model_parallel_size": 2, "training.global_batch_size": 16},
                        8, BARE_CPU),
    "distributed_optimizer_on_cpu": ({"training.use_distributed_optimizer": True,
                                      "parallel.expert_model_parallel_size": 2}, 2, BARE_CPU),
    "interleaved_pipeline": ({"model.num_layers": 4, "parallel.pipeline_model_parallel_size": 2,
                              "parallel.virtual_pipeline_model_parallel_size": 2}, 2, BARE_CPU),
    "tensor_and_expert_parallel": (
        {**TP2, "parallel.expert_model_parallel_size": 2, "training.global_batch_size": 32}, 8,
        EVERYTHING),
    "auto_backend_off_cuda_takes_any_width": ({"moe.ffn_hidden_size": 200}, None, BARE_CPU),
    "grouped_backend_any_width": ({"moe.backend": "grouped", "moe.ffn_hidden_size": 200}, None,
                                  EVERYTHING),
    "weighted_blend": ({"data.data_path": ["0.3", "a", "0.7", "b"]}, None, BARE_CPU),
    "one_prefix": ({"data.data_path": ["/data/c4_text_document"]}, None, BARE_CPU),
    "split_with_spaces": ({"data.split": "98, 2, 0"}, None, BARE_CPU),
    "capacity_factor": ({"moe.expert_capacity_factor": 1.25}, None, BARE_CPU),
    "no_eval": ({"training.eval_interval": 0, "training.eval_iters": 0}, None, BARE_CPU),
    "fp16_with_loss_scale": ({"training.fp16": True, "training.loss_scale": 128.0}, None, EVERYTHING),
    "recompute_full": ({"training.recompute_granularity": "full"}, None, BARE_CPU),
    "gqa": ({"model.num_query_groups": 2}, None, BARE_CPU),
    "cross_entropy_native_with_tensor_parallel": (
        {**TP2, "model.cross_entropy_fusion_impl": "native"}, 2, EVERYTHING),
    "cuda_graphs": ({"training.cuda_graphs": True, "training.bf16": True}, None, EVERYTHING),
    "cuda_graphs_with_symmetric_expert_exchange": (
        {"training.cuda_graphs": True, "training.bf16": True, "parallel.expert_model_parallel_size": 2}, 2,
        EVERYTHING),
    "wgrad_per_step": ({"moe.expert_wgrad_per_step": True, "training.bf16": True}, None, EVERYTHING),
    "wgrad_window_captured": ({"moe.expert_wgrad_window": 2, "training.cuda_graphs": True, "training.bf16": True,
                               "training.global_batch_size": 16, "training.micro_batch_size": 2}, 2, EVERYTHING),
    "wgrad_per_step_sparse_on_cpu": ({"moe.expert_wgrad_per_step": True, "moe.backend": "sparse"}, None, BARE_CPU),
    "deepseek_style_moe": ({"moe.shared_expert_ffn_hidden_size": 256, "moe.shared_expert_gate": True,
                            "moe.router_num_groups": 4, "moe.router_group_topk": 2, "moe.top_k": 4,
                            "moe.aux_loss_type": "sequence"}, None, EVERYTHING),
    "upcycled_fine_grained": ({"checkpoint.upcycle_from": "runs/dense", "moe.upcycle_granularity": 2,
                               "moe.ffn_hidden_size": 256, "moe.aux_loss_type": "global"}, None, EVERYTHING),
    "nvshmem_exchange_rows_of_256_bytes_at_ep2": (
        {"moe.ep_exchange": "nvshmem", "parallel.expert_model_parallel_size": 2, "training.bf16": True}, 2,
        EVERYTHING),
    "gpu_everything": ({"training.device": "cuda", "training.bf16": True,
                        "training.use_distributed_optimizer": True,
                        "model.transformer_impl": "transformer_engine"}, None, EVERYTHING),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_configs_pass(make, name):
    changes, world_size, env = VALID[name]
    validate(make(changes), world_size, env=env)


def test_every_problem_is_reported_at_once(make):
    cfg = make({"moe.top_k": 9, "model.hidden_size": 130, "training.bf16": True,
                "training.fp16": True, "data.split": "1,2", "moe.block_size": 100,
                "training.lr_decay_iters": 5, "logging.log_interval": 0})
    with pytest.raises(ConfigError) as info:
        validate(cfg, env=EVERYTHING)
    keys = [k for k, _ in info.value.problems]
    assert sorted(keys) == sorted([
        "moe.top_k", "model.hidden_size", "training.fp16", "data.split", "moe.block_size",
        "training.lr_decay_iters", "logging.log_interval"])
    assert "(7 problems)" in str(info.value)
    assert all(f"{k}: {m}" in str(info.value) for k, m in info.value.problems)


@pytest.mark.parametrize("key, value, fragment", [
    ("model.num_layers", "two", "expected an integer, got 'two'"),
    ("model.num_layers", 2.0, "expected an integer, got 2.0 (write 2)"),
    ("model.hidden_size", None, "expected an integer, got null"),
    ("training.bf16", 1, "expected true or false, got 1"),
    ("training.bf16", "true", "expected true or false, got 'true'"),
    ("training.lr", "fast", "expected a number, got 'fast'"),
    ("training.lr", float("nan"), "expected a finite number, got nan"),
    ("training.lr", True, "expected a number, got true"),
    ("moe.expert_capacity_factor", "1.5", "expected a number or null, got '1.5'"),
    ("data.data_path", "a", "expected a list of strings, got 'a'"),
    ("data.data_path", ["a", None], "expected a list of strings, got null in the list"),
    ("logging.progress_bar", False, "expected a string, got false"),
])
def test_wrong_types_in_a_config_built_in_code(make, key, value, fragment):
    with pytest.raises(ConfigError) as info:
        validate(make({key: value}), env=EVERYTHING)
    # Exactly one report: checks that read an invalid value are skipped, not crashed or repeated.
    assert info.value.problems == [(key, fragment)]


def test_invalid_source_of_a_derived_value_is_reported_once(make):
    # model.hidden_size feeds model.ffn_hidden_size and moe.ffn_hidden_size when those are null
    cfg = make({"model.hidden_size": -8, "model.ffn_hidden_size": None,
                "moe.ffn_hidden_size": None, "moe.backend": "sparse"})
    with pytest.raises(ConfigError) as info:
        validate(cfg, env=EVERYTHING)
    assert [k for k, _ in info.value.problems] == ["model.hidden_size"]


def test_ints_are_numbers(make):
    validate(make({"training.lr": 1, "training.min_lr": 0}), env=BARE_CPU)


def test_a_section_of_the_wrong_type(make):
    cfg = make()
    cfg.moe = {"num_experts": 8}
    with pytest.raises(ConfigError) as info:
        validate(cfg, env=EVERYTHING)
    assert info.value.problems == [("moe", "expected a MoEConfig, got dict")]


@pytest.mark.parametrize("world_size", [0, -2, 1.5, True])
def test_world_size_must_be_a_count(make, world_size):
    with pytest.raises(ConfigError) as info:
        validate(make(), world_size, env=EVERYTHING)
    assert [k for k, _ in info.value.problems] == ["world_size"]


def test_validate_does_not_change_the_config(make):
    cfg = make({"model.ffn_hidden_size": None})
    before = repr(cfg)
    validate(cfg, env=EVERYTHING)
    assert repr(cfg) == before and cfg.model.ffn_hidden_size is None


def test_choices_match_the_schema_comments():
    """The `a | b | c` comments of schema.py and CHOICES say the same (None, true, false as in YAML
    or Python)."""
    source = inspect.getsource(schema)
    found = {}
    section = None
    for line in source.splitlines():
        head = re.match(r"class (\w+)Config\b", line)
        if head:
            section = {"Model": "model", "MoE": "moe", "Parallel": "parallel",
                       "Training": "training", "Data": "data", "Checkpoint": "checkpoint",
                       "Logging": "logging"}.get(head.group(1))
        m = re.match(r"\s+(\w+): [^=]+=[^#]+#\s*([\w ]+(?:\|[\w ]+)+)", line)
        if m and section:
            words = [w.strip().split()[0] for w in m.group(2).split("|")]
            spelled = {"None": None, "true": True, "false": False}
            found[f"{section}.{m.group(1)}"] = tuple(spelled.get(w, w) for w in words)
    assert found, "no enumerations found in schema.py"
    for key, words in found.items():
        assert CHOICES.get(key) == words, key
    # block_size: "16 | 32 | ..." follows prose; tokenizer_type: its list spans several comment lines
    assert set(CHOICES) - set(found) == {"moe.block_size", "data.tokenizer_type"}


def test_every_number_key_has_a_range():
    """A new numeric key in schema.py needs an entry in RANGES (or CHOICES) of section_checks/values.py."""
    numeric = []
    for section, types in section_types().items():
        for name, annotation in types.items():
            args = typing.get_args(annotation) or (annotation,)
            if any(a in (int, float) for a in args):
                numeric.append(f"{section}.{name}")
    missing = [k for k in numeric if k not in RANGES and k not in CHOICES]
    assert not missing, f"add these keys to RANGES in megatron_dmoe/config/section_checks/values.py: {missing}"


@pytest.mark.parametrize("warmup", [100, 200, 4000])
def test_warmup_as_long_as_the_run_is_a_warning_and_the_schedule_works(make, warmup):
    """Megatron-LM runs `--train-iters 100` with a longer warmup: the rate is still rising at the end."""
    cfg = make({"training.train_iters": 100, "training.lr_warmup_iters": warmup})
    assert find_problems(cfg, env=EVERYTHING) == find_problems(resolve(cfg), env=EVERYTHING) == []
    warning = r"training.lr_warmup_iters: .* not shorter than training.train_iters \(100\)"
    with pytest.warns(ConfigWarning, match=warning):
        validate(cfg, env=EVERYTHING)
    from megatron_dmoe.training.optim import build_scheduler

    class _Optimizer:  # what megatron's OptimizerParamScheduler touches
        param_groups = [{"params": []}]

    scheduler = build_scheduler(resolve(cfg), _Optimizer())
    lrs = []
    for _ in range(100):
        scheduler.step(1)
        lrs.append(_Optimizer.param_groups[0]["lr"])
    assert all(a < b for a, b in zip(lrs, lrs[1:])) and lrs[-1] <= cfg.training.lr


def test_short_warmup_gives_no_warning(make):
    assert find_warnings(make({"training.train_iters": 10, "training.lr_warmup_iters": 5}), env=EVERYTHING) == []


def test_a_check_of_a_few_steps_keeps_its_configs_warmup_without_a_warning(make):
    """`dmoe-train training.train_iters=5` with the shipped warmup of 20: a check that the setup
    runs, not a schedule."""
    assert find_warnings(make({"training.train_iters": 5, "training.lr_warmup_iters": 20}), env=EVERYTHING) == []
    assert find_warnings(make({"training.train_iters": 99, "training.lr_warmup_iters": 99}), env=EVERYTHING) == []


def test_sparse_backend_on_cpu_needs_the_triton_interpreter(make, monkeypatch):
    cfg = make({"moe.backend": "sparse"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the test suite runs the kernels on CPU
    assert find_problems(cfg, env=BARE_CPU) == []
    monkeypatch.delenv("TRITON_INTERPRET")
    assert [k for k, _ in find_problems(cfg, env=BARE_CPU)] == ["moe.backend"]
    assert find_problems(cfg, env=EVERYTHING) == []


def test_fused_router_on_cpu_needs_the_triton_interpreter(make, monkeypatch):
    cfg = make({"moe.router_impl": "fused"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert find_problems(cfg, env=BARE_CPU) == []
    monkeypatch.delenv("TRITON_INTERPRET")
    assert [k for k, _ in find_problems(cfg, env=BARE_CPU)] == ["moe.router_impl"]
    assert find_problems(cfg, env=EVERYTHING) == []


VPP = "virtual_pipeline_model_parallel_size"


def test_virtual_pipeline_rules(make):
    assert VPP in section_types()["parallel"]
    # 4 layers over 2 stages of 2 virtual chunks each: fine; 3 chunks each would need 6 layers
    validate(make({"model.num_layers": 4, "parallel.pipeline_model_parallel_size": 2, f"parallel.{VPP}": 2}),
             env=BARE_CPU)
    problems = find_problems(make({"model.num_layers": 4, "parallel.pipeline_model_parallel_size": 2,
                                   f"parallel.{VPP}": 3}), env=BARE_CPU)
    assert [k for k, _ in problems] == [f"parallel.{VPP}"] and "= 6 model chunks" in problems[0][1], problems
    problems = find_problems(make({f"parallel.{VPP}": 2}), env=BARE_CPU)
    assert [k for k, _ in problems] == [f"parallel.{VPP}"] and "needs parallel.pipeline" in problems[0][1]
