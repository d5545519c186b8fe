"""Which lane each test is in, decided from its file and fixtures (tests/conftest.py marks them):
`slow` (left out of the fast lane) and `mcore` (CI's megatron-core 0.19 leg)."""
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# The fast lane (`pytest -m "not slow and not gpu"`) leaves out every test of a module that starts
# processes (subprocesses, torchrun, spawned process groups) and every test that trains end to end
# (it takes the session corpus, a folder's trained runs or the SLURM cluster). Marked here rather
# than test by test, so that a new test of either kind is caught too; other slow tests carry
# `pytest.mark.slow` themselves.
STARTS_PROCESSES = re.compile(
    r"\b(subprocess|multiprocessing|torchrun|Popen|process_group|ep_runs|run_train)\b|torch\.distributed\.run")
TRAINING_FIXTURES = frozenset({"corpus_cache", "runs", "exported", "slurm_cluster"})
# modules whose processes are quick (no torch in them), kept in the fast lane
QUICK_PROCESSES = {"test_lint.py": "ruff", "test_docs_links.py": "git ls-files"}

# CI's second leg (megatron-core 0.19, `pytest -m mcore`) runs the tests marked `mcore`: every test
# but those here, which cannot tell one megatron-core version from another. A new test module is in
# both legs until it is listed here with its reason.
MCORE_FREE = {
    "kernels/": "dmoe_kernels imports no megatron-core",
    # megatron_dmoe.config imports no megatron-core (config/test_config_is_leaf.py checks it, and
    # stays in both legs with test_moe_settings.py, which reads megatron-core's TransformerConfig);
    # the CLI tests here stop at validation, before anything is built
    "config/test_cuda_graphs_auto.py": "config validation",
    "config/test_dump.py": "config validation",
    "config/test_environment.py": "config validation",
    "config/test_load.py": "config validation",
    "config/test_megatron_names.py": "config validation (Megatron-LM's flag names, ours to keep)",
    "config/test_latent_attention.py": "config validation (multi-latent attention's keys and flags)",
    "config/test_overlap_rules.py": "config validation",
    "config/test_megatron_flags.py": "config validation (Megatron-LM's flags, ours to keep)",
    "config/test_resolve.py": "config validation",
    "config/test_shipped_configs.py": "config validation",
    "config/test_user_errors.py": "config validation",
    "config/test_validate.py": "config validation",
    # megatron_dmoe.sweep imports no megatron-core; the runs a sweep starts are training's, which
    # training/ and parallel/ test in both legs
    "launch/test_sweep_cli.py": "sweeps",
    "launch/test_sweep_concurrent.py": "sweeps (stand-in training commands)",
    "launch/test_sweep_local.py": "sweeps",
    "launch/test_sweep_spec.py": "sweeps",
    "launch/test_sweep_status_time_limit.py": "sweeps",
    "launch/test_sweep_summary.py": "sweeps",
    # launchers: the commands they build and the jobs they submit; the training those start is
    # training's, tested in both legs (resume exactness in training/test_resume.py)
    "launch/test_slurm.py": "SLURM launcher",
    "launch/test_train_sh.py": "torchrun launcher script",
    "launch/test_megatron_lm_check.py": "Megatron-LM check script: its arguments and log comparison (bash only)",
    "launch/test_megatron_lm_layouts.py": "Megatron-LM layouts script: its runs' order and table (bash only)",
    "launch/test_missing_packages.py": "optional packages of ours, refused before anything is built",
    "launch/test_readme_install.py": "README text",
    # README's examples as commands: whether each parses, validates and starts; training itself is
    # tested at both versions (training/, parallel/)
    "launch/test_readme_examples.py": "README's examples",
    # the sparse backend through Triton's interpreter against the float64 reference: dmoe_kernels'
    # products and our autograd functions; what the layer takes from megatron-core (its config, the
    # aux-loss scaler and tracker, DDP's main_grad convention) is the same for every backend and is
    # tested at both versions by moe/test_layer_vs_reference.py, test_shared_grouped_seq.py and
    # test_fused_wgrad_megatron_ddp.py
    "moe/test_sparse_layer.py": "the sparse backend's kernels (interpreter)",
    "moe/test_options_gpu.py": "the sparse backend's kernels (interpreter) with the options",
    "moe/test_per_step_wgrad.py": "the experts' weight gradients once per step, our autograd functions",
    "moe/test_bench_moe.py": "tools/bench_moe.py's report (the layer it times is tested in both legs)",
    # megatron-core's gradient-accumulation convention as our kernels follow it, on plain
    # parameters; megatron-core's DDP reading it: moe/test_fused_wgrad_megatron_ddp.py, both legs
    "moe/test_fused_wgrad.py": "the sparse experts' weight gradients into main_grad, our side",
    # tools/bench_train.py: its rows, children and torchrun; the training it times is dmoe-train's,
    # tested in both legs (the experts' weight gradients once per step: parallel/test_ep_training.py)
    "training/test_bench_train.py": "tools/bench_train.py's report",
    # the shipped default's 200 steps (README's quick start: its size, that it learns, its files);
    # what it runs of megatron-core is tested in both legs: every shipped config built
    # (launch/test_shipped_models.py), the training loop, its checkpoints and evaluation (training/)
    "training/test_default_run.py": "the shipped default run, end to end",
    "test_docs_links.py": "documentation links",
    "test_imports.py": "import graph of the source",
    "test_lint.py": "ruff",
    "test_packaging.py": "what a non-editable install ships (and one build of this checkout at a time)",
}


@functools.lru_cache(maxsize=None)
def _module_source(path):
    return Path(path).read_text(encoding="utf-8")


def _relative(path):
    return Path(path).resolve().relative_to(TESTS).as_posix()


def _mcore_free(path):
    relative = _relative(path)
    return any(relative == entry or (entry.endswith("/") and relative.startswith(entry)) for entry in MCORE_FREE)


def lane_marks(path, fixturenames):
    """The names of the lane markers for a test of the file `path` that takes `fixturenames`."""
    starts_processes = (_relative(path) not in QUICK_PROCESSES
                        and STARTS_PROCESSES.search(_module_source(str(path))))
    slow = bool(starts_processes or TRAINING_FIXTURES.intersection(fixturenames))
    return [name for name, on in (("slow", slow), ("mcore", not _mcore_free(path))) if on]
