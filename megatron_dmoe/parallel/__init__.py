"""The legal parallel layouts, process groups, expert placement and parameter roles.

layout_rules.py     the legal parallel layouts, pure functions over configuration values (no imports):
                    the configuration check reports them, expert_layout.py shares their shard count
distributed.py      torch.distributed and megatron-core's process groups for a run
expert_groups.py    the expert-parallel (EP) and expert-data-parallel groups an MoE layer uses
expert_layout.py    which experts (or expert FFN shards) each EP rank holds, in global terms
param_roles.py      parameter roles (expert-parallel, main_grad_only, ...): the attributes on a
                    Parameter that megatron-core's DDP and our code read, set and read by name here

The exchanges that move rows between expert-parallel ranks (NCCL all-to-all, symmetric memory)
and the dispatcher that uses them are in megatron_dmoe/moe/exchange/: nothing here imports
megatron_dmoe.moe. What CPU runs need of megatron-core (gloo in place of NCCL) is in
megatron_dmoe/compat/cpu/, with the project's other patches of megatron-core.
"""
