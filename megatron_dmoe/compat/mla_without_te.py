"""megatron-core 0.16's multi-latent attention built where Transformer Engine is not installed.

Its module sets HAVE_TE when megatron's Transformer Engine extension imports, which it does without
Transformer Engine (its classes then stand-ins that are not types), so building MLASelfAttention
fails on `isinstance(self.linear_proj, TELinear)`. Needed by 0.16 (checked: 0.16.1); 0.19 takes
HAVE_TE from the extension module, which says False there. Could go with 0.16.
"""
from __future__ import annotations


def allow_mla_without_te() -> None:
    """The MLA module's HAVE_TE as the Transformer Engine extension's own (idempotent)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    if not getattr(te_extension, "HAVE_TE", True):
        multi_latent_attention.HAVE_TE = False
