"""``scripts/sanitize_cases.py``, the compute-sanitizer driver, on the CPU: the case lists it
refuses to mix, and a packed batch (``--varlen``) run and checked end to end in the interpreter."""

import pytest

from flashcore import tuning
from helpers import load_script
from shapes import VARLEN

sanitize_cases = load_script("sanitize_cases")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--deal", "--varlen"], "error: --deal: "),
        (["--deal", "--mla"], "error: --deal: "),
        (["--deal", "--cases", "0"], "error: --deal: "),
        (["--mla", "--varlen"], "error: --mla and --varlen: "),
        (["--varlen", "--cases", "99"], "error: --cases: indices 0..3, not [99]"),
        (["--options", "none,bogus"], "error: --options: unknown ['bogus']"),
    ],
)
def test_refuses(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        sanitize_cases.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_varlen_cases_run_and_are_checked(device, monkeypatch, capsys):
    """The smallest interpreter packed batch (MQA, a sequence without queries and one without
    keys) in place of SANITIZE_VARLEN: forward and backward, full and causal, each checked
    against the float64 reference; a wrong result would fail the run."""
    monkeypatch.setattr(sanitize_cases, "SANITIZE_VARLEN", VARLEN[:1])
    monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", tuning.TMA_MIN_FLOPS)  # main() lowers it
    assert sanitize_cases.main(["--device", device, "--varlen", "--dtypes", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "2/2 cases right" in out
    assert out.count(" packed [fwd ") == 2, out
    if device == "cpu":
        assert out.count(" packed [fwd portable, bwd portable]") == 2, out


def test_a_wrong_packed_result_fails(device, monkeypatch, capsys):
    """The check is live: outputs scaled by 1.01 fail both cases and the run."""
    real = sanitize_cases.run_varlen

    def off(*args, **kwargs):
        out, *rest = real(*args, **kwargs)
        return (out * 1.01, *rest)

    monkeypatch.setattr(sanitize_cases, "SANITIZE_VARLEN", VARLEN[:1])
    monkeypatch.setattr(sanitize_cases, "run_varlen", off)
    monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", tuning.TMA_MIN_FLOPS)
    args = ["--device", device, "--varlen", "--dtypes", "fp16", "--no-backward"]
    assert sanitize_cases.main(args) == 1
    out = capsys.readouterr().out
    assert "0/2 cases right" in out and out.count("FAIL ") == 2
