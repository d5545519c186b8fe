"""tools/bench_overlap.py: its arguments, and one clear line where it cannot run (no CUDA)."""
import importlib.util
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_overlap.py"
spec = importlib.util.spec_from_file_location("bench_overlap", TOOL)
bench_overlap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_overlap)


def test_arguments_are_parsed_and_checked(capsys):
    args = bench_overlap.parse_args(["--ep", "4,2", "--push-programs", "auto,16", "--free-sms", "16,0"])
    assert args.ep == [2, 4] and args.push_programs == [None, 16] and args.free_sms == [0, 16]
    for bad, message in ((["--ep", "1"], "sizes >= 2"), (["--push-programs", "0"], "auto or numbers >= 1"),
                         (["--free-sms", "-4"], "numbers >= 0"), (["--free-sms", "x"], "comma-separated integers"),
                         (["--ep", "two"], "comma-separated integers"), (["--top-k", "65"], "exceeds --experts")):
        with pytest.raises(SystemExit):
            bench_overlap.parse_args(bad)
        assert message in capsys.readouterr().err, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs CUDA GPUs of one host"):
        bench_overlap.main(["--ep", "2"])
