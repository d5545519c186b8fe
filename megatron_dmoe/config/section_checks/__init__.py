"""The configuration check, one module per config section; config/validate.py runs them in order.

state.py      CheckState: the config, its sanitized and resolved copies, the problems and warnings
              found so far, and which keys are invalid (checks that read them are skipped)
values.py     each key on its own: its type, its allowed values (CHOICES), its range (RANGES)
model.py      model.*: heads, query groups, positions, the machine's attention and loss kernels
latent_attention.py model.multi_latent_attention with the keys it reads and those it replaces
moe.py        moe.*: the MoE layer's rules (config/moe_rules.py) on the values the layer will get
upcycle.py    checkpoint.upcycle_from with moe.upcycle_granularity
parallel.py   parallel.*: the legal layouts (parallel/layout_rules.py) and the world size
training.py   training.*: schedule, precision, device, CUDA graphs and the MoE options they govern
fp8.py        training.fp8: the machine it needs (a Hopper GPU or newer) and what it runs with
data.py       data.*: tokenizer type and its files, data paths, split
"""
