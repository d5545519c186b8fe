"""Failures a user meets after the first hour each end in one line (no traceback) that names the
file or setting and what to do, with exit 2 (130 for an interrupt); the run directory stays intact
and no temporary file is left."""




def _one_line(result, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    return message


def test_an_override_without_a_value_is_a_malformed_override(cli_run, tmp_path):
    message = _one_line(cli_run(tmp_path / "run", "training.train_iters"))
    assert "training.train_iters: a malformed override: it has no value" in message
    assert "training.train_iters=VALUE" in message and "config not found" not in message
    assert not (tmp_path / "run").exists()
