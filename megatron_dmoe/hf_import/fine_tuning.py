"""The schedule and sequence length an imported run starts with: fine-tuning a pretrained model,
not the tiny config's training from scratch (its peak learning rate of 2e-3 undoes a pretrained
model's weights within a few steps). dmoe-import prints the ones the user did not set.

- training.lr 1e-5, decaying to training.min_lr 1e-6 (cosine): published full fine-tuning recipes
  of 7B to 70B models use 1e-5 to 2e-5; the low end suits every size;
- training.lr_warmup_iters 20: the import writes empty Adam moments, and with adam_beta2 0.95 the
  second moment averages over about 1 / (1 - 0.95) = 20 steps; until then each update is close to
  lr in size for every weight, so the rate rises over those steps;
- model.seq_length: the model's max_position_embeddings up to 4096, so fine-tuning sees sequences
  as long as the lengths these models are used at, while one sequence's activations stay those of
  a usual pretraining run (lower it where memory is short).
"""
from __future__ import annotations

from typing import Dict

LR = 1e-5
MIN_LR = 1e-6
WARMUP_ITERS = 20
MAX_SEQ_LENGTH = 4096


def fine_tuning_defaults(max_position_embeddings: int) -> Dict[str, object]:
    return {
        "training.lr": LR,
        "training.min_lr": MIN_LR,
        "training.lr_warmup_iters": WARMUP_ITERS,
        "model.seq_length": min(max_position_embeddings, MAX_SEQ_LENGTH),
    }
