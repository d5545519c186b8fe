"""The tensors of a transformers model directory's *.safetensors files: which file holds which name
(read from the files' headers, nothing loaded), checked against the names a model needs, and read
one at a time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable

import torch

from megatron_dmoe.inference.errors import UsageError

INDEX = "model.safetensors.index.json"


def _check_index(hf_dir: Path, files) -> None:
    """A model saved in several files lists them in model.safetensors.index.json: one of them
    missing is named (instead of the tensors it held)."""
    try:
        weight_map = json.loads((hf_dir / INDEX).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # one file, or an index that is not ours to judge: the tensors' names answer
    present = {path.name for path in files}
    listed: Dict[str, int] = {}
    for file in weight_map.values():
        listed[file] = listed.get(file, 0) + 1
    missing = sorted(file for file in listed if file not in present)
    if missing:
        raise UsageError(f"{hf_dir / missing[0]} is missing: {INDEX} names it for {listed[missing[0]]} tensors"
                         + (f" ({len(missing)} files missing)" if len(missing) > 1 else "")
                         + "; copy the model directory whole")


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
        _check_index(Path(hf_dir), files)
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
