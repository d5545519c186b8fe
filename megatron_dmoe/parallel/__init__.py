"""Process groups, expert placement and the exchanges that move rows between ranks.

distributed.py      torch.distributed and megatron-core's process groups for a run
expert_groups.py    the expert-parallel (EP) and expert-data-parallel groups an MoE layer uses
expert_layout.py    which experts (or expert FFN shards) each EP rank holds, in global terms
all_to_all.py       variable-split all-to-all with autograd (NCCL, gloo)
symmetric_exchange.py  rows stored straight into the peers' symmetric memory (the kernels:
                    dmoe_kernels.exchange)
param_roles.py      parameter roles (expert-parallel, main_grad_only, ...): the attributes on a
                    Parameter that megatron-core's DDP and our code read, set and read by name here

The MoE dispatcher that uses these exchanges is megatron_dmoe/moe/dispatch/expert_parallel.py: nothing here
imports megatron_dmoe.moe. What CPU runs need of megatron-core (gloo in place of NCCL) is in
megatron_dmoe/compat/cpu/, with the project's other patches of megatron-core.
"""
