"""Option values: a threshold is a percentage or a fraction below 1, every number has a sane range,
and a bad value is refused naming the option and the problem (issue 47, rows 1, 2 and 12), in the
offline gate's argparse and in a pytest session alike. The parsers are also checked on generated
text (hypothesis): they return a value in their range or refuse by name, never anything else."""

import argparse
import contextlib
import io
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodebench.gate import offline
from decodebench.gate.settings import add_gate_options, policy_from
from decodebench.options import (
    NEGATIVE_VALUE,
    confidence,
    float_up_to,
    fraction,
    fraction_up_to,
    int_up_to,
    non_negative_int,
    output_dir,
    parse_threshold,
    positive_float,
    positive_int,
)
from tests.conftest import REPO

RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")


def offline_usage_error(*args) -> str:
    """What ``python -m decodebench.gate`` prints when it refuses ``args`` (exit 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        offline.main(["a.json", "b.json", *args])
    assert stop.value.code == 2
    return err.getvalue()


def parsed_policy(*args):
    parser = argparse.ArgumentParser()
    add_gate_options(parser.add_argument)
    return policy_from(parser.parse_args(list(args)))


# --- row 1: a bare number of 1 or more is no fraction --------------------------------------------


@pytest.mark.parametrize("option", ["--gate", "--gate-step"])
def test_a_bare_five_is_refused_with_the_percentage_suggested(option):
    # before: accepted as 500 %, so the gate was silently off
    message = offline_usage_error(option, "5")
    assert f"argument {option}: threshold '5' is a bare number of 1 or more" in message
    assert "'5%'" in message


def test_a_percentage_and_a_fraction_below_one_both_read_as_fractions():
    assert parsed_policy("--gate", "5%").threshold == pytest.approx(0.05)
    assert parsed_policy("--gate", "0.05").threshold == pytest.approx(0.05)
    assert parsed_policy("--gate-step", "2.5%").step_threshold == pytest.approx(0.025)


def test_a_bare_number_of_one_or_more_is_refused_by_every_threshold_parser():
    for parse in (fraction, fraction_up_to(1.0), confidence):
        with pytest.raises(argparse.ArgumentTypeError, match="bare number of 1 or more"):
            parse("95")


# --- row 2: a negative value names itself ---------------------------------------------------------


@pytest.mark.parametrize("value", ["-5%", "-0.05", "-5", "-.5%", "-1e-3"])
def test_a_negative_gate_is_refused_by_name_not_as_a_missing_argument(value):
    # before: argparse's "expected one argument" (it took -5% for an option)
    message = offline_usage_error("--gate", value)
    assert "expected one argument" not in message
    # and with the gate's own upper bound (it named the injection's 1000 %)
    assert f"argument --gate: threshold '{value}' must be above 0 and at most 100%" in message


def test_the_negative_value_pattern_takes_numbers_only():
    assert all(NEGATIVE_VALUE.match(v) for v in ("-5%", "-5", "-0.5", "-.5", "-1e-3", "-2.5E+2%"))
    assert not any(NEGATIVE_VALUE.match(v) for v in ("-k", "--gate", "-5x", "-", "-%", "-p", "-e5"))


# --- row 12: sane ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (("--gate-resamples", "1000000"), "argument --gate-resamples: '1000000' must be at most 20"),
    (("--gate-history", "5000"), "argument --gate-history: '5000' must be at most 1000"),
    (("--gate", "150%"), "argument --gate: '150%' must be at most 100%"),
    (("--gate-step-context", "2000000"), "argument --gate-step-context: '2000000' must be at most 1048576"),
    (("--gate-step-context", "0"), "argument --gate-step-context: '0' must be at least 1"),
    (("--gate-step-context", "8k"), "argument --gate-step-context: '8k' is not an integer"),
])
def test_the_offline_gates_numbers_have_an_upper_bound(args, message):
    assert message in offline_usage_error(*args)


@pytest.mark.parametrize(("args", "message"), [
    (("--gate", "5"), "*argument --gate: threshold '5' is a bare number of 1 or more*'5%'*"),
    (("--gate", "-5%"), "*argument --gate: threshold '-5%' must be above 0 and at most 100%*"),
    (("--target-precision", "0%"), "*argument --target-precision: threshold '0%' must be above 0 and at most 50%*"),
    (("--target-precision", "1"), "*argument --target-precision: threshold '1' is a bare number of 1 or more*"),
    (("--target-precision", "80%"), "*argument --target-precision: '80%' must be at most 50%*"),
    (("--gate-resamples", "1000000"), "*argument --gate-resamples: '1000000' must be at most 20*"),
    (("--budget-ms", "1e9"), "*argument --budget-ms: '1e9' must be at most 3.6e+06*"),
    (("--ab-rounds", "100000"), "*argument --ab-rounds: '100000' must be at most 1000*"),
    (("--cpu-threads", "100000"), "*argument --cpu-threads: --cpu-threads '100000': this process may use * CPUs*"),
    (("--verify-tokens", "1,1000"), "*argument --verify-tokens: --verify-tokens '1,1000': at most 64 tokens*"),
])
def test_a_pytest_session_refuses_the_same_values_by_name(pytester, tmp_path, args, message):
    result = pytester.runpytest_inprocess(RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{tmp_path}",
                                          "-p", "no:cacheprovider", "--collect-only", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "expected one argument" not in result.stderr.str()


# --- the parsers on generated text -------------------------------------------------------------------

NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6))
TEXT = st.one_of(
    st.text(max_size=12),
    NUMBERS.map(str),
    NUMBERS.map(lambda v: f"{v}%"),
    st.sampled_from(["", " ", "%", "5 %", "1e400", "-0", "0%", "nan%", "inf", "1_000", "0x10", "५"]),
)


def _refused_by_name(parse, text: str):
    """``parse(text)``: its value, or None when it refused with a message that quotes ``text``."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        refusal = str(exc)
    assert repr(text) in refusal or repr(text.strip()) in refusal, (text, refusal)
    return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(TEXT)
def test_a_threshold_is_a_finite_fraction_in_range_or_a_refusal_quoting_the_text(text):
    for parse, largest in ((fraction, 10.0), (fraction_up_to(1.0), 1.0), (fraction_up_to(0.5), 0.5)):
        value = _refused_by_name(parse, text)
        if value is not None:
            assert math.isfinite(value)
            assert 0 < value <= largest
            if not text.strip().endswith("%"):
                assert value < 1  # a bare number is a fraction below 1, never a percentage


@settings(max_examples=300, deadline=None, derandomize=True)
@given(TEXT)
def test_counts_and_durations_are_in_range_or_a_refusal_quoting_the_text(text):
    for parse, low, high in ((positive_int, 1, math.inf), (non_negative_int, 0, math.inf), (int_up_to(20, 0), 0, 20),
                             (int_up_to(1000), 1, 1000)):
        value = _refused_by_name(parse, text)
        assert value is None or (isinstance(value, int) and low <= value <= high)
    for parse, high in ((positive_float, math.inf), (float_up_to(3600.0), 3600.0)):
        value = _refused_by_name(parse, text)
        assert value is None or (math.isfinite(value) and 0 < value <= high)
    value = _refused_by_name(confidence, text)
    assert value is None or 0.5 <= value < 1


@pytest.mark.parametrize("text", ["0", "-1", "nan", "2000%", "abc", "100%"])
def test_a_confidence_out_of_range_is_refused_with_the_confidence_range(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"must lie in \[50%, 100%\)"):
        confidence(text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.floats(min_value=1e-6, max_value=0.999, allow_nan=False))
def test_a_fraction_and_its_percentage_read_the_same(value):
    assert parse_threshold(repr(value)) == pytest.approx(parse_threshold(f"{value * 100!r}%"))


@pytest.mark.parametrize(("text", "message"), [("", "an empty path"), ("/dev/null/out", "/dev/null is not a directory"),
                                               ("README.md", "README.md is not a directory")])
def test_an_output_directory_that_cannot_be_written_is_refused_by_name(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        output_dir(text)


def test_an_output_directory_yet_to_be_made_under_a_writable_one_is_taken(tmp_path):
    assert output_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    assert not list(tmp_path.iterdir())
