"""The by-hand sweep of issue 47's seventeen faults, as a new user runs them: ``ci/bench`` and
``python -m decodebench ...`` on this machine's CPU stack, storage in a temporary folder.

Each step's command, output, exit status and seconds go to ``OUT/<row>-<step>.txt``; after each
step the processes it started and left (found by a marker in their environment) are listed, and
every stored file of its storage folder is checked: each JSON parses, and each file that was there
before the step is byte-identical after it. ``OUT/results.json`` holds one record per step.

    DECODEBENCH_PYTHON=/path/to/python python validation/faults/sweep.py OUT [ROW ...]
    python validation/faults/sweep.py --table OUT      (OUT/table.md again from OUT/results.json)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = os.environ.get("DECODEBENCH_PYTHON", sys.executable)
BENCH = [str(REPO / "ci" / "bench")]
DB = [PY, "-m", "decodebench"]
FAST = ["-k", "rmsnorm", "-p", "no:cacheprovider"]
TOO_LARGE_TO_READ = 256 << 20


def digests(folder: Path) -> dict[str, str]:
    """Every small file under ``folder``: its SHA-256 (a file too large to be a result: its size)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            size = path.stat().st_size
            out[str(path.relative_to(folder))] = (f"size {size}" if size > TOO_LARGE_TO_READ
                                                  else hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def unreadable(folder: Path) -> list[str]:
    """The JSON files under ``folder`` (up to the size of a result) that do not parse."""
    bad = []
    for path in sorted(folder.rglob("*.json")):
        if path.stat().st_size <= TOO_LARGE_TO_READ:
            try:
                json.loads(path.read_text())
            except ValueError as error:
                bad.append(f"{path.relative_to(folder)}: {error}")
    return bad


def left_running(marker: str) -> list[str]:
    """The processes whose environment carries ``marker`` (the step's own and their children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"SWEEP_MARK={marker}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                found.append(f"{proc.name} {command}")
        except OSError:
            continue
    return found


class Sweep:
    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.records: list[dict] = []

    def step(self, row: str, name: str, argv: list[str], store: Path | None = None, signal_when: tuple | None = None,
             timeout_s: float = 600.0, measure_rss: bool = False, env: dict | None = None) -> dict:
        marker = f"{row}-{name}-{os.getpid()}"
        before = digests(store) if store and store.exists() else {}
        shown = argv
        if measure_rss:
            argv = ["/usr/bin/time", "-f", "max RSS %M kB", *argv]
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DECODEBENCH_PYTHON": PY, "SWEEP_MARK": marker, **(env or {})},
                                start_new_session=True, preexec_fn=_as_from_a_terminal)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        sent = None
        if signal_when:  # (text, count, signal): sent to the session's process once text was printed count times
            text, count, sig = signal_when
            while proc.poll() is None and sum(text in line for line in list(lines)) < count:
                time.sleep(0.2)
            if proc.poll() is None:
                if sig == signal.SIGINT:  # Ctrl-C: a terminal signals the whole process group
                    os.killpg(proc.pid, sig)
                else:  # kill PID, a closed terminal: ci/bench execs pytest, so this is the session's process
                    os.kill(proc.pid, sig)
                sent = (f"{signal.Signals(sig).name} once {count} lines said {text.strip()!r}, "
                        f"{time.monotonic() - started:.1f} s in")
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            lines.append(f"\n[sweep: killed after {timeout_s} s]")
        reader.join(timeout=10)
        output = "".join(lines)
        seconds = time.monotonic() - started
        time.sleep(2.0)  # a worker that outlives its session does so by about a second
        left = left_running(marker)
        after = digests(store) if store and store.exists() else {}
        changed = [k for k in before if before[k] != after.get(k)]
        record = {"row": row, "step": name, "command": " ".join(str(a) for a in shown), "signal": sent,
                  "rc": proc.returncode, "seconds": round(seconds, 1), "left_running": left,
                  "stored_changed_or_lost": changed, "stored_unreadable": unreadable(store) if store else [],
                  "stored_new": sorted(set(after) - set(before)), "output_file": f"{row}-{name}.txt"}
        text = (f"$ {record['command']}\n" + (f"[sweep: sent {sent}]\n" if sent else "") + output +
                f"\n[sweep: exit {proc.returncode}, {seconds:.1f} s, left running: {left or 'none'}, stored files "
                f"changed or lost: {changed or 'none'}, unreadable: {record['stored_unreadable'] or 'none'}, "
                f"new: {record['stored_new'] or 'none'}]\n")
        (self.out / record["output_file"]).write_text(text.replace(str(self.work), "$TMP"))
        record["command"] = record["command"].replace(str(self.work), "$TMP").replace(str(REPO) + "/", "")
        self.records.append(record)
        print(f"{row} {name}: exit {proc.returncode} in {seconds:.1f} s, left {len(left)}", flush=True)
        return record


def _as_from_a_terminal() -> None:
    """SIGHUP and SIGINT as a terminal's shell leaves them to a command (the sweep itself may run under
    nohup, in the background, where both are ignored and its children would inherit that)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


KEY_LINES = ("ERROR:", "gate ", "decodebench.gate:", "decodebench gate:", "skipped stored result", "EXTRAPOLATED",
             "decodebench: another session", "python -m decodebench", "Comparing against", "Saved benchmark data",
             "max RSS", "E   ", "stalled", "FAILED ", "[sweep: sent", "breakdown:", "scenarios:", "error:")


def key_lines(text: str, most: int = 4) -> list[str]:
    """The lines of a step's output that say what happened (errors, conclusions, refusals)."""
    found = [line.strip() for line in text.splitlines()
             if (line.lstrip().startswith(KEY_LINES) or ": error: " in line or "stalled" in line)
             and not line.startswith(("$ ", "ERROR: usage:", "decodebench gate: re-measure"))]
    return found[:most]


def table(records: list[dict], out: Path) -> str:
    """The markdown rows of the sweep: step, command, what it printed, seconds, processes left, files whole."""
    rows = ["| row | command | what it printed (key lines; the whole output in the file) | exit | s | left running "
            "| stored files whole |", "|---|---|---|---|---|---|---|"]
    for r in records:
        first = r["output_file"].split(",")[0].strip()
        printed = " / ".join(key_lines((out / first).read_text())) or "(see file)"
        whole = "yes" if not r["stored_changed_or_lost"] and not r["stored_unreadable"] else (
            f"NO: {r['stored_changed_or_lost'] + r['stored_unreadable']}")
        cell = lambda text: text.replace("|", "\\|")  # noqa: E731
        rows.append(f"| {r['row']} {r['step']} | `{cell(r['command'])}` | {cell(printed)} | {r['rc']} | {r['seconds']} "
                    f"| {len(r['left_running'])} | {whole} ([{first}]({out.name}/{first})) |")
    return "\n".join(rows) + "\n"


def fingerprint_dir(store: Path) -> Path:
    (folder,) = [p for p in store.iterdir() if p.is_dir()]
    return folder


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=4))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--table"]:
        out = Path(argv[1]).resolve()
        (out / "table.md").write_text(table(json.loads((out / "results.json").read_text()), out))
        return 0
    out = Path(argv[0]).resolve()
    rows = set(argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sweep-"))
    sweep = Sweep(out, work)
    want = lambda row: not rows or row in rows  # noqa: E731

    # two stored runs and a current one, as a user's first days leave them
    base = work / "base"
    for i in (1, 2):
        sweep.step("setup", f"run{i}", [*BENCH, *FAST, f"--benchmark-storage=file://{base}"], base)
    current = work / "current.json"
    sweep.step("setup", "current", [*BENCH, *FAST, f"--benchmark-storage=file://{work / 'other'}",
                                    f"--benchmark-json={current}"], work / "other")
    runs = sorted(fingerprint_dir(base).glob("*.json"))

    def store_copy(name: str) -> tuple[Path, Path]:
        store = work / name
        shutil.copytree(base, store)
        return store, fingerprint_dir(store)

    def gate_offline(row, name, folder, cur, *more):
        return sweep.step(row, name, [*DB, "gate", str(folder), str(cur), "--gate", "5%", *more], folder)

    if want("1"):
        for opt in ("--gate", "--gate-step"):
            sweep.step("1", opt.strip("-"), [*BENCH, *FAST, opt, "5", f"--benchmark-storage=file://{base}"], base)
    if want("2"):
        sweep.step("2", "gate-negative", [*BENCH, *FAST, "--gate", "-5%", f"--benchmark-storage=file://{base}"], base)
    if want("3"):
        store, folder = store_copy("r3")
        shutil.copy(runs[0], folder / runs[0].name.replace("0001_", "0003_"))
        sweep.step("3", "live", [*BENCH, *FAST, "--gate", "5%", f"--benchmark-storage=file://{store}"], store)
        gate_offline("3", "offline", folder, current)
    if want("4"):
        store, folder = store_copy("r4")
        path = sorted(folder.glob("0002_*.json"))[0]
        edit_json(path, lambda d: (d["benchmarks"][0]["stats"].update(data=[]),
                                   d["benchmarks"][1]["stats"].pop("data")))
        gate_offline("4", "offline", folder, current)
    if want("5"):
        empty = work / "current-empty.json"
        shutil.copy(current, empty)
        edit_json(empty, lambda d: [b["stats"].update(data=[]) for b in d["benchmarks"]])
        gate_offline("5", "offline", fingerprint_dir(base), empty)
    if want("6"):
        store, folder = store_copy("r6")
        path = sorted(folder.glob("0002_*.json"))[0]
        edit_json(path, lambda d: d["benchmarks"].append(d["benchmarks"][0]))
        gate_offline("6", "offline", folder, current)
    if want("7"):
        store, folder = store_copy("r7")
        late = sorted(folder.glob("0002_*.json"))[0]
        late.rename(folder / late.name.replace("0002_", "9999_"))
        sweep.step("7", "save-after-9999", [*BENCH, *FAST, f"--benchmark-storage=file://{store}"], store)
        sweep.step("7", "next-session", [*BENCH, *FAST, "--gate", "5%", f"--benchmark-storage=file://{store}"], store)
    if want("8"):
        store, folder = store_copy("r8")
        gated = [*BENCH, *FAST, "--gate", "5%", f"--benchmark-storage=file://{store}"]
        sweep.step("8", "live-without-it", gated, store, measure_rss=True)  # its memory without the large file
        with open(folder / "0050_big.json", "wb") as big:
            big.truncate(2 << 30)  # sparse: 2 GB to the reader, nothing on the disk
        sweep.step("8", "live", [*BENCH, *FAST, "--gate", "5%", f"--benchmark-storage=file://{store}"], store,
                   measure_rss=True)
        gate_offline("8", "offline", folder, current)
    if want("9") or want("10"):
        kimi = json.loads((REPO / "decodebench" / "models" / "kimi-k2.5" / "config.json").read_text())
        for row, fields, extra in (("9", {"n_routed_experts": 7, "num_experts_per_tok": 4}, ["--ep", "1"]),
                                   ("10", {"hidden_size": 10**9}, [])):
            if not want(row):
                continue
            model = work / f"model{row}"
            model.mkdir()
            changed = json.loads(json.dumps(kimi))
            changed["text_config"].update(fields)
            (model / "config.json").write_text(json.dumps(changed))
            sweep.step(row, "rmsnorm", [*BENCH, *FAST, "--model", str(model), *extra,
                                        f"--benchmark-storage=file://{work / ('s' + row)}"], base)
            sweep.step(row, "moe", [*BENCH, "-k", "moe", "-p", "no:cacheprovider", "--model", str(model), *extra,
                                    f"--benchmark-storage=file://{work / ('s' + row)}"], base)
    if want("11"):
        sweep.step("11", "decode", [*BENCH, "benchmarks/test_decode.py", "--concurrency", "30000:30000",
                                    f"--benchmark-storage=file://{base}"], base)
    if want("12"):
        for name, opt in (("target-precision", ["--target-precision", "1"]),
                          ("gate-resamples", ["--gate", "5%", "--gate-resamples", "1000000"])):
            sweep.step("12", name, [*BENCH, *FAST, *opt, f"--benchmark-storage=file://{base}"], base)
    if want("13"):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            store, folder = store_copy(f"r13-{sig.name}")
            sweep.step("13", sig.name, [*BENCH, *FAST, "-v", "--gate", "5%", f"--benchmark-storage=file://{store}"],
                       store, signal_when=(" PASSED", 4, sig))  # while measuring: 4 of 16 cases done
            sweep.step("13", f"{sig.name}-then-gate", [*BENCH, *FAST, "--gate", "5%",
                                                       f"--benchmark-storage=file://{store}"], store)
    if want("14"):
        store, folder = store_copy("r14")
        argv = [*BENCH, *FAST, "--gate", "5%", f"--benchmark-storage=file://{store}"]
        marker = f"14-pair-{os.getpid()}"
        env = {**os.environ, "DECODEBENCH_PYTHON": PY, "SWEEP_MARK": marker}
        started = time.monotonic()
        procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  preexec_fn=_as_from_a_terminal) for _ in range(2)]
        outputs = [p.communicate(timeout=900)[0] for p in procs]
        seconds = time.monotonic() - started
        time.sleep(2.0)
        left = left_running(marker)
        for i, (p, text) in enumerate(zip(procs, outputs, strict=True), 1):
            (out / f"14-session{i}.txt").write_text((f"$ {' '.join(argv)}   (two at once)\n{text}\n"
                                                     f"[sweep: exit {p.returncode}]\n").replace(str(work), "$TMP"))
        shown = " ".join(argv).replace(str(work), "$TMP").replace(str(REPO) + "/", "")
        sweep.records.append({"row": "14", "step": "two-sessions", "command": shown + "  (two at once)",
                              "rc": [p.returncode for p in procs],
                              "seconds": round(seconds, 1), "left_running": left, "stored_changed_or_lost": [],
                              "stored_unreadable": unreadable(store),
                              "output_file": "14-session1.txt, 14-session2.txt"})
        print(f"14: exits {[p.returncode for p in procs]} in {seconds:.1f} s, left {len(left)}", flush=True)
    if want("15"):
        fake = work / "fake-python"
        fake.write_text(f'#!/bin/sh\nexec "{PY}" "{REPO / "tests" / "fake_vllm_server.py"}" "$@"\n')
        fake.chmod(0o755)
        sweep.step("15", "stall", [*BENCH, "benchmarks/test_decode.py", "-p", "no:cacheprovider", "--server-python",
                                   str(fake), "--input-len", "8", "--output-len", "6", "--concurrency", "1,4",
                                   "--server-arg=--fake-stall-at 3 --fake-token-s 0.01", "--e2e-stall-s", "10",
                                   f"--benchmark-storage=file://{work / 's15'}"], work / "s15")
    if want("16") or want("17"):
        sys.path.insert(0, str(REPO))
        from tests.test_attribution import two_windows
        from tests.test_scenarios import stored
        inputs = work / "attribution"
        inputs.mkdir()
        traces, kernels = two_windows(inputs), stored(inputs)  # the tests' synthetic H200-like inputs
        if want("16"):
            common = [*DB, "breakdown", str(traces), "--model", "kimi-k2.5"]
            sweep.step("16", "tp3", [*common, "--tp", "3"], inputs)
            sweep.step("16", "layers1000", [*common, "--tp", "8", "--server-layers", "1000"], inputs)
            sweep.step("16", "what-if-no-context", [*common, "--tp", "8", "--predict-from", str(kernels),
                                                    "--what-if", "allreduce=0.5x"], inputs)
            sweep.step("16", "scenarios-tp3", [*DB, "scenarios", str(kernels), "--batch", "1", "--tp", "3"], inputs)
        if want("17"):
            sweep.step("17", "scenarios", [*DB, "scenarios", str(kernels), "--batch", "1,64,256"], inputs)

    (out / "results.json").write_text(json.dumps(sweep.records, indent=2) + "\n")
    (out / "table.md").write_text(table(sweep.records, out))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
