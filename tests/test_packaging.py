"""What a non-editable install ships: every package of the source tree, enough to train."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("top", ["megatron_dmoe", "kernels"])
def test_every_source_folder_is_a_package(top):
    # setup.py's find_packages() skips a folder without __init__.py, so a wheel would lack it.
    missing = [
        str(folder.relative_to(ROOT))
        for folder in sorted((ROOT / top).rglob("*"))
        if folder.is_dir() and "__pycache__" not in folder.parts
        and any(folder.glob("*.py")) and not (folder / "__init__.py").exists()
    ]
    assert not missing, f"folders with modules but no __init__.py (left out of a wheel): {missing}"


@pytest.mark.slow
def test_a_non_editable_install_trains_from_outside_the_checkout(tmp_path, corpus_cache):
    # built from a copy: setuptools builds inside the source folder, and the suite may run twice at once
    source = tmp_path / "source"
    for folder in ("megatron_dmoe", "kernels", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("setup.py", "README.md"):
        shutil.copy(ROOT / file, source / file)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # -S: no .pth files, so an editable install of this checkout cannot answer the imports; the
    # installed dependencies come from site-packages on the path after the install under test.
    path = os.pathsep.join([str(target)] + [p for p in sys.path if p.endswith("-packages")])
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import megatron_dmoe.training.loop, dmoe_kernels, megatron_dmoe;"
         "print(megatron_dmoe.__file__)"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=300,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout
    run = subprocess.run(
        [sys.executable, "-S", str(target / "bin" / "dmoe-train"), "--run-dir", str(outside / "run"),
         "training.train_iters=2", "training.eval_interval=0", f"data.cache_dir={corpus_cache}",
         "logging.progress_bar=off"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (outside / "run" / "config.yaml").exists()
    assert (outside / "run" / "checkpoints" / "latest").read_text().strip() == "2"
