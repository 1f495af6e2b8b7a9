"""The headline tables of docs/ recomputed from the raw files under validation/ they name.

Each test reads a table (or a headline sentence) of a page and the committed files it was made
from, recomputes every figure, and fails naming the row that differs, as tests/test_readme_examples.py
does for the gate lines.
"""

import gzip
import json
import re
import statistics
import sys

import pytest

from validation.tests.evidence import REPO

DOCS = REPO / "docs"
H200 = REPO / "validation" / "h200"
GATE = H200 / "gate"


def page_text(page: str) -> str:
    """The text of ``page``: a page of docs/ (``gate.md``) or a report (``reports/gate-model.md``)."""
    return ((REPO / "validation" / page) if page.startswith("reports/") else (DOCS / page)).read_text()


def table_after(page: str, marker: str) -> list[list[str]]:
    """The cells of the first markdown table after ``marker`` in ``page`` (:func:`page_text`), header and rule
    left out."""
    text = page_text(page)
    assert marker in text, f"{page} no longer holds {marker!r}"
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.replace("**", "").strip() for cell in line.strip("|").split("|")])
    return rows


def stored_power():
    sys.path.insert(0, str(REPO / "validation" / "gpu"))
    try:
        import stored_power
    finally:
        sys.path.pop(0)
    return stored_power


def sessions(*paths):
    return [json.loads(gzip.decompress(path.read_bytes())) for path in paths]


def tally(*paths):
    return stored_power().tally(sessions(*paths))


def caught_cell(row: dict, cases: int) -> str:
    """How a family's catch reads in the doc: ``9``, or ``15 of 15`` where fewer of its cases were injected."""
    return str(row["caught"]) if row["injected"] == cases else f"{row['caught']} of {row['injected']}"


def spread_cell(*rows: dict) -> str:
    """The median run spread of a family in each session, as the doc's range (``1.2–1.3 %`` or ``0.6 %``)."""
    medians = sorted(f"{statistics.median(r['spreads']) * 100:.1f}" for r in rows)
    low, high = medians[0], medians[-1]
    return f"{low} %" if low == high else f"{low}–{high} %"


LEASE5 = GATE / "stored-power-lease5"


def test_the_stored_power_table_of_validation_md_is_what_the_three_sessions_hold():
    ten = tally(LEASE5 / "inject10-gate5" / "stored-power-1.json.gz")
    five = tally(LEASE5 / "inject5-gate3" / "stored-power-1.json.gz")
    none = tally(LEASE5 / "inject0-gate5" / "stored-power-1.json.gz")
    rows = table_after("reports/gate-stored-power-h200.md", "| family | cases | median run spread | +10 % at 5 %")
    families = {row[0].strip("`"): row for row in rows if row[0].startswith("`")}
    assert set(families) == set(ten) == set(five) == set(none)
    for name, row in families.items():
        want = [str(ten[name]["trials"]), spread_cell(ten[name], five[name], none[name]),
                caught_cell(ten[name], ten[name]["trials"]), str(ten[name]["undecided"]),
                caught_cell(five[name], ten[name]["trials"]),
                str(five[name]["undecided"]), str(none[name]["false_alarms"]), str(none[name]["undecided"])]
        assert row[1:] == want, name
    total = {k: sum(r[k] for r in ten.values()) for k in ("trials", "caught", "undecided")}
    (all_row,) = [row for row in rows if row[0] == "all"]
    assert all_row[1] == str(total["trials"])
    assert all_row[3] == f"{total['caught']} ({total['caught'] / total['trials']:.1%})".replace("%", " %")
    caught5, injected5 = (sum(r[k] for r in five.values()) for k in ("caught", "injected"))
    assert all_row[5] == f"{caught5} of {injected5} ({caught5 / injected5:.1%})".replace("%", " %")
    alarms, undecided = (sum(r[k] for r in none.values()) for k in ("false_alarms", "undecided"))
    assert all_row[7:9] == [str(alarms), f"{undecided} ({undecided / total['trials']:.1%})".replace("%", " %")]


def unchanged_sessions():
    return [LEASE5 / "inject0-gate5" / "stored-power-1.json.gz",
            GATE / "stored-power-lease9" / "inject0-gate5" / "stored-power-1.json.gz"]


def test_the_false_alarm_figure_counts_only_sessions_that_could_raise_one():
    # a session that slows every case it reaches cannot show a false alarm: only unchanged sessions count
    documents = sessions(*unchanged_sessions())
    assert not any("injected_slowdown" in (b.get("extra_info") or {}) for d in documents for b in d["benchmarks"])
    rows = stored_power().tally(documents)
    trials = sum(r["trials"] for r in rows.values())
    assert sum(r["false_alarms"] for r in rows.values()) == 0
    phrase = f"no false alarm in the two unchanged sessions, {trials}\n  case-sessions"
    assert phrase in (DOCS / "gate.md").read_text()
    assert f"{trials}\n  case-sessions, 0 SLOWER" in page_text("reports/gate-stored-power-h200.md")


LEASE9 = GATE / "stored-power-lease9"


def lease9_sessions():
    return sorted(LEASE9.glob("inject5-gate3-*/stored-power-*.json.gz"))


def test_the_five_percent_table_of_validation_md_is_what_the_four_sessions_hold():
    paths = lease9_sessions()
    assert len(paths) == 4
    rows = tally(*paths)
    table = table_after(
        "reports/gate-stored-power-h200.md", "| family | trials | caught | UNDECIDED | median run spread |"
    )
    families = {row[0].strip("`"): row for row in table if row[0].startswith("`")}
    assert set(families) == set(rows)
    for name, row in families.items():
        r = rows[name]
        want = [str(r["trials"]), f"{r['caught']} ({r['caught'] / r['injected']:.0%})".replace("%", " %"),
                str(r["undecided"]), f"{statistics.median(r['spreads']):.2%}".replace("%", " %")]
        assert row[1:] == want, name


def test_the_headline_detection_figures_are_what_the_sessions_hold():
    ten = tally(LEASE5 / "inject10-gate5" / "stored-power-1.json.gz")
    five = tally(*lease9_sessions())
    documents = sessions(*lease9_sessions())
    tight = [b["extra_info"]["gate"] for d in documents for b in d["benchmarks"]
             if "injected_slowdown" in b["extra_info"] and b["extra_info"]["gate"]["spread"] <= 0.01]
    caught10, cases10 = sum(r["caught"] for r in ten.values()), sum(r["trials"] for r in ten.values())
    caught5, trials5 = sum(r["caught"] for r in five.values()), sum(r["trials"] for r in five.values())
    tight_caught = sum(g["verdict"] == "slower" for g in tight)
    gate = " ".join((DOCS / "gate.md").read_text().split())
    assert f"+10 % caught on {caught10} of {cases10} cases at `--gate 5%`" in gate
    assert f"+5 % at `--gate 3%` in {caught5} of {trials5} trials over four sessions" in gate
    assert f"all {tight_caught} on cases whose run spread is at most 1 %" in gate
    assert tight_caught == len(tight)
    validation = " ".join(page_text("reports/gate-stored-power-h200.md").split())
    assert f"{caught5} of {trials5} trials caught" in validation
    assert f"**{tight_caught} of {len(tight)}**" in validation


def test_the_offline_power_table_of_validation_md_is_the_committed_json():
    rows = json.loads((GATE / "offline-power.json").read_text())
    table = table_after("reports/gate-model.md", "| scale | gate | SLOWER | SAME | UNDECIDED |")
    assert len(table) == len(rows)
    for row, want in zip(table, rows, strict=True):
        counts = want["counts"]
        assert row == [f"{want['scale']:.2f}", f"{want['gate'] * 100:.0f} %", str(counts.get("slower", 0)),
                       str(counts.get("same", 0)), str(counts.get("undecided", 0)), str(want["tight_slower"])]


def test_the_c1_prediction_table_of_attribution_md_is_the_committed_attribution_json():
    table = {
        row[0]: row[1:] for row in table_after("reports/attribution-h200.md", "**Prediction vs profile at C = 1**")
    }
    for column, layers in enumerate(("L4", "L2")):
        load = json.loads((H200 / f"attribution-{layers}.json").read_text())["c1-in1024-out128"]
        predicted, profiled = load["prediction"]["groups_us"], load["components_us"]
        moe = profiled["moe_gemm"] + profiled["moe_glue"]
        benchmarked = moe + sum(profiled[k] for k in ("dense_gemm", "rmsnorm", "routing", "mla_attention"))
        total = load["prediction"]["total_us"]
        assert table["predicted kernel time / step"][column] == f"{total:.0f} µs"
        assert table["profiled, benchmarked components"][column] == \
            f"{benchmarked:.0f} µs ({(total / benchmarked - 1) * 100:+.1f} %)".replace("-", "−")
        for label, group, now in (("dense GEMMs (largest at C=1)", "dense_gemm", profiled["dense_gemm"]),
                                  ("MoE (GEMMs + glue)", "moe", moe)):
            change = f"{(predicted[group] / now - 1) * 100:+.1f} %".replace("-", "−")
            assert table[label][column] == f"{predicted[group]:.0f} vs {now:.0f} ({change})", label
        assert table["routing (top-k)"][column] == f"{predicted['routing']:.1f} vs {profiled['routing']:.1f}"
        change = f"{(predicted['rmsnorm'] / profiled['rmsnorm'] - 1) * 100:+.0f} %".replace("-", "−")
        assert table["RMSNorm"][column] == f"{predicted['rmsnorm']:.0f} vs {profiled['rmsnorm']:.0f} ({change})"


def test_the_l4u_table_of_attribution_md_is_the_committed_breakdown():
    text = (H200 / "attrib" / "L4u-attribution.txt").read_text()
    loads = {}
    for load, predicted, profiled, pct in re.findall(
            r"^(c\d+-in1024-out128(?:-n256)?): predicted kernel time ([\d.]+) µs vs profiled ([\d.]+) µs "
            r"of benchmarked components \(\s*([+-]\d+\.\d)%\)", text, re.MULTILINE):
        loads[load] = (predicted, profiled, pct)
    rows = {
        row[0]: row for row in table_after("reports/attribution-h200.md", "| load | predicted vs profiled, benchmarked")
    }
    for label, load in (("C = 1", "c1-in1024-out128"), ("C = 64", "c64-in1024-out128"),
                        ("C = 256", "c256-in1024-out128"), ("64:256 (`bench serve`'s load)", "c64-in1024-out128-n256")):
        predicted, profiled, pct = loads[load]
        cell = rows[label][1].replace("−", "-")
        assert cell.startswith(f"{predicted} vs {profiled} µs, "), label
        assert cell.endswith(f"{float(pct):+.1f} %"), label


@pytest.mark.parametrize("page", ["benchmarks.md", "reports/ep-h200.md"])
def test_the_ep_projection_table_is_the_committed_scenarios(page):
    text = (H200 / "ep" / "measured" / "scenarios.txt").read_text()
    projected: dict[int, dict[str, tuple[float, float]]] = {}
    m = None
    for line in text.splitlines():
        if (head := re.search(r"\(M=(\d+), L=", line)):
            m = int(head.group(1))
        hit = re.match(r"\s+moe=(ep8(?::agrs|:a2a)?) vs TP \(rtx-pro-6000-x8-pcie\): predicted kernels "
                       r"([\d.]+) -> ([\d.]+) \(([+-][\d.]+) µs", line)
        if hit:
            projected.setdefault(m, {})[hit.group(1)] = (float(hit.group(2)), float(hit.group(3)), float(hit.group(4)))
    assert sorted(projected) == [1, 64, 256]
    if page == "benchmarks.md":
        rows = [row for row in table_after(page, "| C | TP 8 | EP 8 as vLLM runs it") if row]
        cells = {int(row[0]): row[1:5] for row in rows}
    else:
        rows = table_after(page, "| where | C | TP 8 |")
        cells = {int(row[1]): row[2:6] for row in rows if row[0].startswith("RTX PRO 6000")}
    assert sorted(cells) == [1, 64, 256]
    for c, row in cells.items():
        tp = projected[c]["ep8"][0] / 1000
        assert row[0].removesuffix(" ms") == f"{tp:.2f}", c
        for cell, kind in zip(row[1:], ("ep8", "ep8:agrs", "ep8:a2a"), strict=True):
            _, after, change = projected[c][kind]
            assert cell.replace("−", "-") == f"{after / 1000:.2f} ({change / 1000:+.2f})", (c, kind)


def test_the_test_time_table_of_development_md_is_what_the_raw_runs_printed():
    rows = table_after("development.md", "| run | commit | machine | tests took |")
    assert rows
    for row in rows:
        raw = (REPO / "validation" / "cpu" / "test-time" / row[5].strip("`")).read_text()
        (summary,) = re.findall(r"^(\d+) passed, (\d+) skipped, .* in [\d.]+s \((\d+):(\d+):(\d+)\)$", raw,
                                re.MULTILINE)
        passed, skipped, _, minutes, seconds = summary
        assert row[3] == f"{int(minutes)} min {int(seconds)} s", row
        assert row[4] == f"{passed} passed, {skipped} skipped", row
        assert row[1] in raw.splitlines()[0], row


def test_the_what_if_check_of_attribution_md_is_the_committed_verify_file():
    text = (H200 / "attrib" / "whatif-verify.txt").read_text()
    rows = {
        row[0]: row
        for row in table_after("reports/attribution-h200.md", "| load | predicted change | measured, all kernels")
    }
    for label, load in (("C = 1", "c1-in1024-out128"), ("C = 64", "c64-in1024-out128")):
        block = text[text.index(f"{load}: predicted change"):]
        predicted = re.match(rf"{load}: predicted change ([+-][\d.]+)", block).group(1)
        busy, busy_pct = re.search(r"measured all kernels \(busy\)\s+([+-][\d.]+)\s+predicted/measured - 1 = "
                                   r"([+-][\d.]+) %", block).groups()
        mla, mla_pct = re.search(r"measured mla_attention components\s+([+-][\d.]+)\s+predicted/measured - 1 = "
                                 r"([+-][\d.]+) %", block).groups()
        row = [cell.replace("−", "-") for cell in rows[label]]
        assert row[1].startswith(predicted), label
        assert row[2].startswith(f"{busy} µs ({busy_pct} %)") or row[2] == f"{busy} ({busy_pct} %)", label
        assert row[3].startswith(f"{mla} µs ({mla_pct} %)") or row[3] == f"{mla} ({mla_pct} %)", label
        assert ("yes" in row[4]) == (abs(float(busy_pct)) <= 25), label


def spec_blocks(path):
    """The tables of a spec_verify file: (title line, {(C, K): error %})."""
    blocks, title = [], None
    for line in path.read_text().splitlines():
        if line.startswith("carried from"):
            title = line
            blocks.append((title, {}))
        hit = re.match(r"test_decode\[c(\d+)-\S+-ngram(\d)\]\s+.*\s([\d.]+)\s+([+-][\d.]+)%\s+(?:yes|NO)", line)
        if hit and blocks:
            blocks[-1][1][(int(hit.group(1)), int(hit.group(2)))] = (hit.group(3), hit.group(4))
    return blocks


def test_the_two_machine_spec_check_of_attribution_md_is_the_committed_verify_files():
    table = table_after("reports/spec.md", "| load | machine a: measured | carried constant")
    rows = {row[0]: [cell.replace("−", "-") for cell in row[1:]] for row in table}
    for offset, machine in ((0, "machine-a"), (4, "machine-b")):
        folder = H200 / "spec" / "check-lease8" / machine
        constant = spec_blocks(folder / "verify-host-per-token.txt")[0]
        window, host = spec_blocks(folder / "verify.txt")
        assert constant[0].endswith("--no-async-scheduling")
        assert "--window-prefill" in window[0]
        assert "--host-from" in host[0]
        assert len(constant[1]) == len(window[1]) == len(host[1]) == 4
        for (c, k), (measured, error) in window[1].items():
            row = rows[f"C = {c}, K = {k}"][offset:offset + 4]
            assert row[0].removesuffix(" µs") == measured, (machine, c, k)
            assert row[1:] == [f"{constant[1][c, k][1]} %", f"{error} %", f"{host[1][c, k][1]} %"], (machine, c, k)


def test_the_h200_kernel_tables_of_validation_md_are_what_validation_tables_prints():
    import subprocess

    done = subprocess.run([sys.executable, str(REPO / "validation" / "validation_tables.py")], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env={"PYTHONPATH": str(REPO)}, check=False)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    page = page_text("reports/kernels-h200.md") + page_text("reports/timers-h200.md")
    mla = [line for line in printed if line.startswith("| b")]
    assert len(mla) == 3
    for line in mla:
        assert line in page, line
    moved = [re.match(r"test_dense_gemm\[(\w+)-\S+-m(\d+)-vllm\]: ([+-]\d+\.\d)%", line).groups()
             for line in printed if line.startswith("test_dense_gemm[")]
    assert "5 of them moved more than 5 %" in page
    assert len(moved) == 5
    flat = " ".join(page.split())
    q_a = [pct.lstrip("+") for op, _, pct in moved if op == "q_a"]
    assert f"up by {q_a[0]}, {q_a[1]} and {q_a[2]} %" in flat
    for op, _, pct in moved:
        if op != "q_a":
            word = "up" if pct.startswith("+") else "down"
            assert f"{word} by {pct.lstrip('+-')} %" in flat, (op, pct)
    for line in printed:
        if (hit := re.match(r"timer (\w+): second lease against the first, ([+-][\d.]+)% to ([+-][\d.]+)%", line)):
            mode, low, high = hit.groups()
            if mode == "wall":  # the page rounds the wall clock's wide range to whole percent
                low, high = f"{float(low):+.0f}", f"{float(high):+.0f}"
            assert f"{mode} by {low.replace('-', '−')} to {high.replace('-', '−')} %" in flat or \
                f"medians moved by {low} to {high} %" in flat, line
