"""validation/attribution/spec_verify.py: the speculative-decoding prediction against measured ``--spec`` runs, on
literal numbers and on the committed H200 checks validation/reports/spec.md quotes."""

from __future__ import annotations

import json

import pytest

from decodebench.attribution.predict.step import KernelResult
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes
from validation.attribution import spec_verify
from validation.tests.evidence import REPO


def norm(name, tokens, us, per_request=1):
    shape = {"tokens": tokens, "role": "hidden", "fused_add": True, **({"per_request": per_request}
                                                                       if per_request > 1 else {})}
    return KernelResult(name, "rmsnorm", "vllm", shape, us * 1e-6)


def test_spec_verify_predicts_from_the_measured_tokens_per_step():
    spec = load_model_spec("tiny-kimi")
    results = [norm("m1", 1, 2.0), norm("m1x3", 3, 3.0, per_request=3)]
    calls = DecodeShapes.for_deployment(spec, 1).norms_per_step[("hidden", True)]
    plain = {"name": "plain", "extra_info": {"mean_tpot_ms": 0.1, "max_concurrency": 1, "input_len": 32,
                                             "output_len": 16}}
    counters = {"k": 2, "tokens_per_step": 2.5, "drafted_share": 0.8, "acceptance_rate": 0.75}
    bench = {"name": "spec", "extra_info": {"mean_tpot_ms": 0.05, "max_concurrency": 1, "input_len": 32,
                                            "output_len": 16, "spec_decode": counters}}
    row = spec_verify.check_load(bench, plain, results, spec, 1)
    carried = 100.0 - calls * 2.0
    assert row.predicted_us == pytest.approx((0.8 * calls * 3.0 + 0.2 * calls * 2.0 + carried) / 2.5)
    assert row.error == pytest.approx(row.predicted_us / 50.0 - 1)


def test_spec_verify_host_term_grows_with_the_tokens_a_step_emits():
    # the carried term's growth per request across the plain server's loads, applied to every
    # token a speculative step emits beyond C
    spec = load_model_spec("tiny-kimi")
    results = [norm("m1", 1, 2.0), norm("m4", 4, 2.0), norm("m1x3", 3, 3.0, per_request=3)]
    calls = DecodeShapes.for_deployment(spec, 1).norms_per_step[("hidden", True)]
    def load(c, tpot_ms):
        return {"name": f"c{c}", "extra_info": {"mean_tpot_ms": tpot_ms, "max_concurrency": c,
                                                                   "input_len": 32, "output_len": 16}}
    plain = {1: load(1, 0.100), 4: load(4, 0.130)}
    h = spec_verify.host_per_token_us(plain, results, spec, 1)
    assert h == pytest.approx(10.0)  # (130 - 100) µs over 3 more requests; the kernels are the same
    counters = {"k": 2, "tokens_per_step": 2.5, "drafted_share": 1.0, "acceptance_rate": 0.75}
    bench = {"name": "spec", "extra_info": {**load(1, 0.05)["extra_info"], "spec_decode": counters}}
    row = spec_verify.check_load(bench, plain[1], results, spec, 1, host_per_token=h)
    assert row.carried_us == pytest.approx(100.0 - calls * 2.0 + 10.0 * 1.5)
    assert row.predicted_us == pytest.approx((calls * 3.0 + row.carried_us) / 2.5)
    assert row.beyond_us == pytest.approx((50.0 - row.predicted_us) * 2.5)
    with pytest.raises(ValueError, match="plain loads at two C"):
        spec_verify.host_per_token_us({1: plain[1]}, results, spec, 1)


def test_spec_verify_calibrated_host_term_is_a_plus_b_k_per_c_from_other_ks(tmp_path):
    # calibration loads at K = 1 and 3 (their step beyond the prediction 1000 and 1400 µs) give
    # 800 + 200 K; a load at K = 2 gets 1200 µs added to its step, and a calibrated K is never checked
    spec = load_model_spec("tiny-kimi")
    results = [norm("m1", 1, 2.0)] + [norm(f"m1x{k + 1}", k + 1, 2.0 + k, per_request=k + 1) for k in (1, 2, 3)]
    calls = DecodeShapes.for_deployment(spec, 1).norms_per_step[("hidden", True)]
    info = {"max_concurrency": 1, "input_len": 32, "output_len": 16}
    plain_tpot_us = 100.0
    carried = plain_tpot_us - calls * 2.0

    def spec_load(k, beyond_us):
        tps = 1.0 + k * 0.5
        tpot_us = (calls * (2.0 + k) + carried + beyond_us) / tps  # drafted on every step
        counters = {"k": k, "tokens_per_step": tps, "drafted_share": 1.0, "acceptance_rate": 0.5}
        return {"name": f"k{k}", "extra_info": {**info, "mean_tpot_ms": tpot_us / 1e3, "component": "decode_e2e",
                                                "spec_decode": counters}}

    def file(tmp, name, *benches):
        path = tmp / f"{name}.json"
        path.write_text(json.dumps({"benchmarks": list(benches)}))
        return path

    plain = file(tmp_path, "plain", {"name": "plain", "extra_info": {**info, "mean_tpot_ms": plain_tpot_us / 1e3,
                                                                 "component": "decode_e2e"}})
    cal = [file(tmp_path, "k1", spec_load(1, 1000.0)), file(tmp_path, "k3", spec_load(3, 1400.0))]
    term = spec_verify.calibrate_host(results, spec, plain, cal, 1, checked_ks=[2])
    assert term.coefficients(1) == pytest.approx((800.0, 200.0))
    rows = spec_verify.checks(results, spec, plain, [file(tmp_path, "k2", spec_load(2, 1200.0))], 1, 0.15, host=term)
    assert rows[0].carried_us == pytest.approx(carried + 1200.0)
    assert rows[0].error == pytest.approx(0.0)
    with pytest.raises(ValueError, match="K=3 is both a calibration and a checked load"):
        spec_verify.calibrate_host(results, spec, plain, cal, 1, checked_ks=[3])
    with pytest.raises(ValueError, match="no calibration load at C=64"):
        term.at(64, 2)


def test_spec_verify_calibrated_on_lease6s_k2_reads_its_k4(capsys):
    # H200 lease 6: K = 2's host time per step, held constant (one K calibrates a constant), brings
    # C = 1's K = 4 within 15 % and leaves C = 64's 20.7 % short (it grows with K there)
    d, k = (
        REPO / "validation" / "h200" / "spec" / "check-lease6",
        REPO / "validation" / "h200" / "spec" / "check-lease5",
    )
    common = [str(k / "kernels.json.gz"), "--spec-run", str(d / "ngram4.json"),
              "--plain-sync", str(d / "plainsync.json"), "--model", "kimi-k2.5", "--tp", "1", "--server-layers", "4"]
    assert spec_verify.main(common + ["--host-from", str(d / "ngram2.json")]) == 1
    out = capsys.readouterr().out
    assert "C=1: 1189 + 0 x K µs (from K=2: 1189)" in out
    assert "-4.9%  yes" in out
    assert "-20.7%  NO" in out
    assert out.splitlines()[-1] == "1 of 2 within 15%"
    assert spec_verify.main(common + ["--host-from", str(d / "ngram4.json")]) == 2
    assert "K=4 is both a calibration and a checked load" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("machine", "window_only", "both"), [("machine-a", "2 of 4", "4 of 4"), ("machine-b", "4 of 4", "4 of 4")]
)
def test_spec_verify_on_lease8_reads_the_window_prefill_and_the_calibrated_host(capsys, machine, window_only, both):
    # H200 lease 8, two machines: the wave's prefill held per output token brings C = 64 within 10 %
    # from the plain server alone; the host term calibrated on K = 1 and 3 brings every load within 15 %
    d = REPO / "validation" / "h200" / "spec" / "check-lease8" / machine
    common = [str(d / "kernels.json.gz"), "--spec-run", str(d / "ngram2.json"), "--spec-run", str(d / "ngram4.json"),
              "--plain-sync", str(d / "plainsync.json"), "--window-prefill", "--model", "kimi-k2.5", "--tp", "1",
              "--server-layers", "4"]
    spec_verify.main(common)
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"{window_only} within 15%"
    c64 = [line for line in out.splitlines() if line.startswith("test_decode[c64")]
    assert len(c64) == 2
    assert all(-0.10 < float(line.split()[-4].rstrip("%")) / 100 < 0 for line in c64)
    code = spec_verify.main(common + ["--host-from", str(d / "ngram1.json"), "--host-from", str(d / "ngram3.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[-1] == f"{both} within 15%"
    assert "less the prefill inside a request's decode window" in out
    assert "(from K=1: " in out
    assert out == (d / "verify.txt").read_text().split("\n", 1)[1].rsplit("# exit", 1)[0]


def test_window_prefill_needs_the_plain_loads_itl():
    with pytest.raises(ValueError, match="c64: no mean_itl_ms and median_itl_ms"):
        spec_verify.window_prefill_us({"name": "c64", "extra_info": {"mean_tpot_ms": 1.0}})
    assert spec_verify.window_prefill_us({"name": "c1", "extra_info": {"mean_itl_ms": 2.9, "median_itl_ms": 3.0}}) == 0


def test_spec_verify_on_the_lease6_check_with_the_host_term(capsys):
    # H200 lease 6: C = 64 in one wave; the host term brings C = 64 within 15 %, not C = 1
    d, k = (
        REPO / "validation" / "h200" / "spec" / "check-lease6",
        REPO / "validation" / "h200" / "spec" / "check-lease5",
    )
    code = spec_verify.main(
        [
            str(k / "kernels.json.gz"),
            "--spec-run",
            str(d / "ngram2.json"),
            "--spec-run",
            str(d / "ngram4.json"),
            "--plain-sync",
            str(d / "plainsync.json"),
            "--host-per-token",
            "--model",
            "kimi-k2.5",
            "--tp",
            "1",
            "--server-layers",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "plus 56.0 µs per token a step emits beyond C" in out
    assert out.splitlines()[-1] == "2 of 4 within 15%"


def test_spec_verify_on_the_committed_h200_check_reads_both_engine_modes(capsys):
    # H200 lease 5 (validation/reports/spec.md): ngram turns async scheduling off, so the plain server's
    # carried term is read in both modes; the verdict is the sync one's
    d = REPO / "validation" / "h200" / "spec" / "check-lease5"
    code = spec_verify.main(
        [
            str(d / "kernels.json.gz"),
            "--plain",
            str(d / "plain.json"),
            "--spec-run",
            str(d / "ngram2.json"),
            "--spec-run",
            str(d / "ngram4.json"),
            "--plain-sync",
            str(d / "plainsync.json"),
            "--model",
            "kimi-k2.5",
            "--tp",
            "1",
            "--server-layers",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1  # not every load within 15 %
    assert out.count("\nload ") == 3
    assert "carried from the plain server with --no-async-scheduling" in out
    assert "verdict: each load against the plain server in its method's engine mode" in out
    assert out.splitlines()[-1] == "1 of 4 within 15%"
    sync_rows = out.split("--no-async-scheduling")[1]
    assert "-13.8%  yes" in sync_rows.split("ngram2]")[1].splitlines()[0]


def test_spec_verify_takes_either_plain_server_and_refuses_neither(capsys):
    d = REPO / "validation" / "h200" / "spec" / "check-lease5"
    common = [str(d / "kernels.json.gz"), "--spec-run", str(d / "ngram2.json"), "--model", "kimi-k2.5", "--tp", "1",
              "--server-layers", "4"]
    assert spec_verify.main(common + ["--plain-sync", str(d / "plainsync.json")]) == 1  # C = 64 misses
    out = capsys.readouterr().out
    assert "async scheduling)" not in out
    assert out.count("\nload ") == 1
    assert "verdict" not in out
    assert out.splitlines()[-1] == "1 of 2 within 15%"
    with pytest.raises(SystemExit) as exit_info:
        spec_verify.main(common)
    assert exit_info.value.code == 2
    assert "give --plain, --plain-sync or both" in capsys.readouterr().err
