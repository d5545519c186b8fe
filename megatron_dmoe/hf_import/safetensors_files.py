"""The tensors of a transformers model directory's *.safetensors files: which file holds which name
(read from the files' headers, nothing loaded), checked against the names a model needs, and read
one at a time."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable

import torch

from megatron_dmoe.inference.errors import UsageError


class SafetensorsFiles:
    def __init__(self, hf_dir: Path):
        try:
            from safetensors import safe_open
        except ImportError:
            raise UsageError("dmoe-import reads *.safetensors and needs the safetensors package: "
                             "pip install 'megatron-dmoe[hf]' (or safetensors)") from None
        self._open = safe_open
        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in Path(hf_dir).glob("*.bin"))
            extra = f" (it has {', '.join(found[:2])}: save with safe_serialization)" if found else ""
            raise UsageError(f"{hf_dir} has no *.safetensors files{extra}; dmoe-import reads safetensors only")
        self.where: Dict[str, Path] = {}
        for path in files:
            try:
                with safe_open(str(path), "pt") as f:
                    for name in f.keys():
                        self.where[name] = path
            except Exception as err:  # safetensors raises its own SafetensorError for a bad header
                raise UsageError(f"{path} is not a readable safetensors file: {err}") from None
        self._handles = {}

    def check_names(self, needed: Iterable[str], what: str, ignored: Iterable[str] = ()) -> None:
        """UsageError naming the first tensor missing, or the first one the model would not use."""
        needed = list(needed)
        missing = [n for n in needed if n not in self.where]
        if missing:
            raise UsageError(f"the *.safetensors files hold no tensor {missing[0]} ({len(missing)} missing), which "
                             f"{what} needs; are they the weights config.json describes?")
        unused = sorted(set(self.where) - set(needed) - set(ignored))
        if unused:
            raise UsageError(f"the *.safetensors files hold {len(unused)} tensor(s) {what} has no place for, such "
                             f"as {unused[0]}: this model would drop them")

    def read(self, name: str) -> torch.Tensor:
        path = self.where[name]
        if path not in self._handles:
            self._handles[path] = self._open(str(path), "pt")
        return self._handles[path].get_tensor(name)
