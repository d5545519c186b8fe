"""scripts/megatron_lm_layouts.sh without a GPU: its help, its refusals, and the order and table of
its runs, with a stand-in for megatron_lm_check.sh beside a copy of it (the real script's
--compare does the comparisons)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# stands in for megatron_lm_check.sh: --compare goes to the real script; a run records its arguments
# and writes Megatron-LM's per-iteration log lines for its layout (losses from LOSSES_<layout>)
STAND_IN = r"""#!/usr/bin/env bash
if [[ $1 == --compare ]]; then exec bash "$REAL_CHECK" "$@"; fi
echo "$*" >> "$WORK_DIR/calls.txt"
tp=1 pp=1 ep=1 sp=0
while [[ $# -gt 0 ]]; do
    case $1 in --tp) tp=$2; shift ;; --pp) pp=$2; shift ;; --ep) ep=$2; shift ;; --sp) sp=1 ;; esac
    shift
done
layout=tp$tp; [[ $sp == 1 ]] && layout+=_sp; layout+=_pp${pp}_ep$ep
var=LOSSES_$layout
i=0
for loss in ${!var}; do
    i=$((i + 1))
    echo " iteration $i/ 3 | lm loss: $loss | load_balancing_loss: 1.0E+00 |" >> "$WORK_DIR/train_$layout.log"
done
var=STATUS_$layout
exit "${!var:-0}"
"""


def _layouts(tmp_path, env_extra, *args):
    folder = tmp_path / "scripts"
    folder.mkdir(exist_ok=True)
    shutil.copy(SCRIPTS / "megatron_lm_layouts.sh", folder)
    (folder / "megatron_lm_check.sh").write_text(STAND_IN)
    (tmp_path / "mlm").mkdir(exist_ok=True)
    work = tmp_path / "work"
    env = {**os.environ, "WORK_DIR": str(work), "REAL_CHECK": str(SCRIPTS / "megatron_lm_check.sh"),
           "LOSSES_tp1_pp1_ep1": "10.4 9.9 9.1", **env_extra}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(["bash", str(folder / "megatron_lm_layouts.sh"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=env)
    return proc, work


def test_help_names_the_layouts_and_the_settings():
    proc = subprocess.run(["bash", str(SCRIPTS / "megatron_lm_layouts.sh"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for text in ("--tp 2 --sp", "--pp 2", "--ep 2", "LAYOUT_TIMEOUT", "WORK_DIR", "--init"):
        assert text in proc.stdout


@pytest.mark.parametrize("args, env, message", [
    (["{tmp}/absent"], {}, "MEGATRON_LM_DIR '{tmp}/absent' is not a folder"),
    (["{tmp}/mlm", "{tmp}/absent"], {}, "WHEEL_DIR '{tmp}/absent' is not a folder"),
    (["{tmp}/mlm"], {"LAYOUT_TIMEOUT": "soon"}, "LAYOUT_TIMEOUT 'soon': give a number of seconds"),
])
def test_refused_in_one_line_before_any_run(tmp_path, args, env, message):
    proc, work = _layouts(tmp_path, env, *(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"megatron_lm_layouts: error: {message.format(tmp=tmp_path)}"
    assert not (work / "calls.txt").exists()


def test_every_layout_against_the_one_gpu_run_from_one_checkpoint(tmp_path):
    proc, work = _layouts(tmp_path, {"LOSSES_tp2_sp_pp1_ep1": "10.4 9.9 9.1",
                                     "LOSSES_tp1_pp2_ep1": "10.4 9.91 9.1",
                                     "LOSSES_tp1_pp1_ep2": "10.4 9.9 9.2", "STATUS_tp1_pp1_ep2": "1"},
                          tmp_path / "mlm")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    calls = (work / "calls.txt").read_text().splitlines()
    init, ref = f"--init {work}/init", f"--reference {work}/train_tp1_pp1_ep1.log"
    assert calls == [f"{tmp_path}/mlm {init}", f"{tmp_path}/mlm {init} --tp 2 --sp {ref}",
                     f"{tmp_path}/mlm {init} --pp 2 {ref}", f"{tmp_path}/mlm {init} --ep 2 {ref}"]
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in proc.stdout.splitlines()[-4:]}
    assert rows["tp1_pp1_ep1"] == ["-", "-", "pass"]
    assert rows["tp2_sp_pp1_ep1"] == ["3", "0", "pass"]
    assert rows["tp1_pp2_ep1"][:2] == ["3", "0.01"] and rows["tp1_pp2_ep1"][2] == "pass"
    assert rows["tp1_pp1_ep2"][:2] == ["3", "0.1"] and rows["tp1_pp1_ep2"][2].startswith("FAIL (status 1")


def test_no_layout_runs_when_the_one_gpu_run_fails(tmp_path):
    proc, work = _layouts(tmp_path, {"STATUS_tp1_pp1_ep1": "1"}, tmp_path / "mlm")
    assert proc.returncode == 1
    assert len((work / "calls.txt").read_text().splitlines()) == 1
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("tp1_pp1_ep2") and last.endswith("not run (the one-GPU run failed)")
