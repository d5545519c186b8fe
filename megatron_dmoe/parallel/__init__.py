"""Process groups and expert-parallel token exchange.

distributed.py      torch.distributed and megatron-core's process groups for a run
expert_groups.py    the expert-parallel (EP) and expert-data-parallel groups an MoE layer uses
expert_layout.py    which experts (or expert FFN shards) each EP rank holds, in global terms
all_to_all.py       variable-split all-to-all with autograd
expert_dispatcher.py  the TokenDispatcher that sends tokens to the ranks of their experts and back
"""
