"""validation/machine_paths.py: what it takes for a machine's path, what it writes instead, and that a rewrite keeps
everything else of a file (a JSON document's structure, a .gz's determinism, a .tgz's members)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import pytest

from validation.tests.evidence import validation_script

paths = validation_script("validation/machine_paths.py")


# the tops of a machine's paths, joined here so that this file holds no machine path itself (the check covers it too)
W, R, H = "/work", "/root", "/home"


@pytest.mark.parametrize(("old", "new"), [
    (f"rootdir: {W}/main\n", "rootdir: <checkout>\n"),
    (f"{W}/main/.venv/bin/python -m pytest", "<checkout>/.venv/bin/python -m pytest"),
    (f'"model": "{W}/wt-27/fixtures/models/tiny-kimi"', '"model": "<checkout>/fixtures/models/tiny-kimi"'),
    (f"$ {W}/wt/faults2/ci/bench -k rmsnorm", "$ <checkout>/ci/bench -k rmsnorm"),
    (f"Python 3.11.7 /check{W}/main/.venv/bin/python", "Python 3.11.7 <checkout>/.venv/bin/python"),
    (f"../../..{W}/main/benchmarks/test_mla.py ..   [ 85%]", "<checkout>/benchmarks/test_mla.py ..   [ 85%]"),
    (f"name='{R}/nights/night-1.json'>", "name='~/nights/night-1.json'>"),
    (f'File "{R}/vllm-site/vllm/renderers/base.py", line 251', 'File "~/vllm-site/vllm/renderers/base.py", line 251'),
    (f"{H}/ann/x.py:3 and HOME={H}/ann", "~/x.py:3 and HOME=~"),
    # not a machine's home or checkout: scratch, system paths, ~/, a path inside a word, root's home without a slash
    (f"/tmp/pytest-of-root/p0 /opt/torch/.venv ~{R}/x a{W}/b https://x.org{H}/ HOME={R}",
     f"/tmp/pytest-of-root/p0 /opt/torch/.venv ~{R}/x a{W}/b https://x.org{H}/ HOME={R}"),
])
def test_a_machine_prefix_becomes_its_placeholder_and_the_rest_stays(old, new):
    assert paths.rewritten(old.encode()).decode() == new
    assert not paths.FOUND.search(new.encode())


def test_the_check_finds_what_the_rewrite_takes():
    text = f"a {W}/main/x b ../..{R}/y c /check{W}/main d {H}/ann/e /tmp/f ~/g /usr/h".encode()
    assert [f.path.decode() for f in paths.found_in("t.txt", text)] == [f"{W}/main/x", f"../..{R}/y",
                                                                        f"/check{W}/main", f"{H}/ann/e"]
    assert paths.found_in("t.txt", paths.rewritten(text)) == []


def test_a_file_without_a_machine_path_is_left_byte_for_byte():
    data = gzip.compress(b'{"a": "/tmp/x", "b": 1.5}', mtime=123)
    new, found = paths.walk("r.json.gz", data, rewrite=True)
    assert new is data
    assert found == []


def test_a_json_document_keeps_its_structure_and_figures():
    old = {"argv": [f"{W}/main/.venv/bin/python", "-m"], "stats": {"mean": 0.000123456789, "rounds": 7},
           "env": f'{{"dir": "{R}/tp8/traces"}}', "none": None}
    new, found = paths.walk("r.json", json.dumps(old, indent=4).encode(), rewrite=True)
    assert [f.line for f in found] == [3, 10]
    assert json.loads(new) == {"argv": ["<checkout>/.venv/bin/python", "-m"], "stats": old["stats"],
                               "env": '{"dir": "~/tp8/traces"}', "none": None}


def test_a_gz_is_written_as_gzip_n_does_the_same_bytes_each_time():
    data = gzip.compress(f"line {R}/out/a.json\n".encode() * 50, mtime=1_796_000_000)
    one, found = paths.walk("server.log.gz", data, rewrite=True)
    two, _ = paths.walk("server.log.gz", data, rewrite=True)
    assert one == two
    assert one[3] == 0  # no name
    assert one[4:8] == b"\0\0\0\0"  # mtime 0
    assert gzip.decompress(one) == b"line ~/out/a.json\n" * 50
    assert found[0].where == "server.log.gz"
    assert found[-1].line == 50


def tgz(members) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, mode, body in members:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime, info.uname, info.uid = mode, 1_796_327_711, "root", 0
            if body is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return gzip.compress(out.getvalue(), mtime=0)


def test_a_tgz_keeps_its_members_names_order_modes_and_times():
    long = "root/.cache/vllm/" + "d" * 90 + "/inductor_cache/x.py"
    data = tgz([("logs", 0o555, None), ("logs/b.log", 0o444, f"rootdir: {W}/main\n".encode()),
                (long, 0o644, f"# {R}/x\n".encode()),
                ("logs/t.json.gz", 0o644, gzip.compress(f'["{R}/tp8/traces/a.pt.trace.json.gz"]'.encode(), mtime=9)),
                ("logs/a.log", 0o644, b"no path\n")])
    new, found = paths.walk("logs.tgz", data, rewrite=True)
    assert new == paths.walk("logs.tgz", data, rewrite=True)[0]
    assert [f.where for f in found] == ["logs.tgz:logs/b.log", f"logs.tgz:{long}", "logs.tgz:logs/t.json.gz"]
    with tarfile.open(fileobj=io.BytesIO(data)) as old_tar, tarfile.open(fileobj=io.BytesIO(new)) as new_tar:
        olds, news = old_tar.getmembers(), new_tar.getmembers()
        assert [(m.name, m.mode, m.mtime, m.uname, m.type) for m in olds] == [
            (m.name, m.mode, m.mtime, m.uname, m.type) for m in news]
        bodies = {m.name: new_tar.extractfile(m).read() for m in news if m.isfile()}
    assert bodies["logs/b.log"] == b"rootdir: <checkout>\n"
    assert bodies[long] == b"# ~/x\n"
    assert json.loads(gzip.decompress(bodies["logs/t.json.gz"])) == ["~/tp8/traces/a.pt.trace.json.gz"]
    assert bodies["logs/a.log"] == b"no path\n"
    assert paths.walk("logs.tgz", new, rewrite=False)[1] == []
