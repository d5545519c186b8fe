"""Write the resolved config of a run, with the software versions that ran it."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Dict, Optional, Union

from .load import DERIVED_KEY, EXTENDS_KEY, IGNORED_KEYS, config_to_dict
from .resolve import resolve
from .schema import SECTIONS, RunConfig
from .yaml_io import dump_yaml

# Distribution names on the package registry, as importlib.metadata knows them.
_DISTRIBUTIONS = {
    "torch": "torch",
    "megatron-core": "megatron-core",
    "triton": "triton",
    "megatron_dmoe": "megatron-dmoe",
}


def software_versions() -> Dict[str, str]:
    """Python's version and each installed package's (missing packages are left out)."""
    versions = {"python": platform.python_version()}
    for label, dist in _DISTRIBUTIONS.items():
        try:
            versions[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def config_to_yaml(cfg: RunConfig, header: Optional[Dict[str, object]] = None) -> str:
    """YAML text of ``cfg`` (as given, not resolved) after the ``header`` blocks.

    Header keys become top-level blocks ahead of the sections; only ``versions`` is ignored when
    the text is loaded again, so other names make the file fail to load.
    """
    header = dict(header or {})
    clash = [k for k in header if k in SECTIONS or k == EXTENDS_KEY]
    if clash:
        raise ValueError(f"header keys {clash} would replace config sections; "
                         f"use {', '.join(IGNORED_KEYS)}")
    body = dump_yaml({**header, **config_to_dict(cfg)})
    return "# megatron_dmoe run configuration\n" + body


def save_config(cfg: RunConfig, path: Union[str, os.PathLike],
                versions: Optional[Dict[str, str]] = None) -> Path:
    """Write ``resolve(cfg)`` to ``path`` with a ``versions:`` block and a ``derived:`` list (the
    keys resolve() filled in); returns the path.

    ``versions`` None records software_versions(). The file loads back with load_config to a
    RunConfig equal to resolve(cfg). The write is atomic: a reader never sees half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    resolved = resolve(cfg)
    header = {"versions": software_versions() if versions is None else dict(versions)}
    if resolved.derived:  # loaded again, resolve() derives them from their sources' values then
        header[DERIVED_KEY] = list(resolved.derived)
    text = config_to_yaml(resolved, header)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open(), unlike mkstemp, keeps umask
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a read-only folder refuses the cleanup too: keep the first error
            tmp.unlink(missing_ok=True)
        raise
    return path
