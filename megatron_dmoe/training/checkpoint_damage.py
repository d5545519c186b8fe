"""Whether a saved checkpoint's files are whole, checked by reading only what describes them.

A checkpoint directory (megatron-core's torch_dist format) holds metadata.json (the format),
.metadata (torch.distributed.checkpoint's index: every item's file, offset and length), the
shards `__R_N.distcp` the index points into, and common.pt (the common state; megatron-core 0.19
keeps it inside the shards instead). A file cut off by a full disk, an interrupted copy or a
truncating sync is found here and named, instead of surfacing as a traceback (metadata.json,
common.pt) or as a load error that names no file (a shard).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

METADATA_JSON = "metadata.json"
DCP_INDEX = ".metadata"
COMMON = "common.pt"


def _index_ends(path: Path) -> Dict[str, int]:
    """{shard file: the bytes the index says it holds}; raises when .metadata cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    ends: Dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    return dict(ends)


def _short(err: BaseException) -> str:
    """The error's first sentence (torch's zip reader appends a paragraph of advice)."""
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    return text.split(". ")[0].rstrip(".")


def _size_problem(file: Path, expected: Optional[int] = None) -> Optional[str]:
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size == 0:
        return f"{file} is empty"
    if expected is not None and size < expected:
        return f"{file} is cut off ({size} of {expected} bytes)"
    return None


def checkpoint_damage(path: Path) -> Optional[str]:
    """What makes the checkpoint directory `path` unusable, naming the file ('.../common.pt is cut
    off'); None when every file is whole. Reads the small files only (and the shards' sizes)."""
    path = Path(path)
    problem = _size_problem(path / METADATA_JSON)
    if problem:
        return problem
    try:
        fmt = json.loads((path / METADATA_JSON).read_text())
    except (OSError, ValueError) as err:
        return f"{path / METADATA_JSON} cannot be read, as when cut off ({_short(err)})"
    if not isinstance(fmt, dict) or fmt.get("sharded_backend") != "torch_dist":
        return None  # another format: megatron-core's loader answers for it
    problem = _size_problem(path / DCP_INDEX)
    if problem:
        return problem
    try:
        ends = _index_ends(path)
    except Exception as err:  # a cut-off pickle raises whatever unpickling stopped at
        return f"{path / DCP_INDEX} cannot be read, as when cut off ({_short(err)})"
    for name, end in sorted(ends.items()):
        problem = _size_problem(path / name, end)
        if problem:
            return problem
    if (path / COMMON).exists():
        problem = _size_problem(path / COMMON)
        if problem:
            return problem
        try:
            import torch

            torch.load(path / COMMON, map_location="cpu", weights_only=False)
        except Exception as err:  # a cut-off zip archive or pickle
            return f"{path / COMMON} cannot be read, as when cut off ({_short(err)})"
    elif not any(name.startswith("common_state") for name in _item_names(path)):
        return f"{path / COMMON} is missing"  # and the shards do not hold the common state (0.19) either
    return None


def _item_names(path: Path) -> List[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return [index.fqn for index in FileSystemReader(str(path)).read_metadata().storage_data]


def checkpoint_iterations(root: Path) -> List[int]:
    """The iterations of the checkpoint directories under `root` (staging ones left out), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (p.name[len("iter_"):] for p in root.glob("iter_*") if p.is_dir())
    return sorted(int(text) for text in found if text.isdigit())


def newest_whole_before(root: Path, iteration: Optional[int]) -> Optional[Path]:
    """The newest checkpoint directory under `root` before `iteration` (any, for None) whose
    files are whole; None when there is none."""
    for older in reversed(checkpoint_iterations(root)):
        path = Path(root) / f"iter_{older:07d}"
        if (iteration is None or older < iteration) and checkpoint_damage(path) is None:
            return path
    return None


def iteration_of(path: Path) -> int:
    return int(Path(path).name[len("iter_"):])


def damage_message(path: Path, continue_with: Optional[str] = None) -> Optional[str]:
    """One line when the checkpoint `path` is damaged: the file, and the previous whole checkpoint
    kept next to it with how to use it (its iteration written into `latest`, then the command
    `continue_with`); None when whole."""
    damage = checkpoint_damage(path)
    if damage is None:
        return None
    root = Path(path).parent
    older = newest_whole_before(root, iteration_of(path))
    if older is None:
        offer = "no older complete checkpoint is kept; restore the file, or start over with --overwrite"
    else:
        offer = (f"the previous complete checkpoint is {older}: to continue from it, write "
                 f"{iteration_of(older)} into {root / 'latest'}"
                 + (f", then run: {continue_with}" if continue_with else "") + " (or restore the file)")
    return f"the checkpoint {path} is damaged: {damage}; {offer}"
