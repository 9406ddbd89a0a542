"""Output folders: ``report -o`` and the tour never overwrite a file qkov did not write, and a bad
output location is an error before any analysis, leaving nothing behind."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qkov import QkovError
from qkov.apps.outputs import output_folder, written_by_qkov
from qkov.apps.report import write_report
from qkov.io.checkpoint import save_checkpoint

from hand_built import hand_built
from helpers import run_main


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hand") / "ckpt"
    save_checkpoint(hand_built(), path)
    return path


def test_report_never_overwrites_a_page_it_did_not_write(hand: Path, tmp_path: Path, capsys) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<html>my page</html>")
    rc, out, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2)
    assert rc == 2 and out == ""
    assert err.strip().count("\n") == 0 and "was not written by qkov" in err and "pass --force" in err
    assert "…" not in err, "refused before any analysis stage started"
    assert (site / "index.html").read_text() == "<html>my page</html>" and not (site / "report.json").exists()
    rc, _, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2, "--force", "--quiet")
    assert rc == 0, err
    assert written_by_qkov(site / "index.html") and written_by_qkov(site / "report.json")
    # qkov's own report is replaced without asking
    rc, _, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2, "--quiet")
    assert rc == 0, err
    # a report.json that is not qkov's is refused too
    (site / "report.json").write_text(json.dumps({"mine": True}))
    with pytest.raises(QkovError, match="report.json.*not written by qkov"):
        write_report(hand, site, batch=2, icl_examples=2)
    assert json.loads((site / "report.json").read_text()) == {"mine": True}


def test_a_bad_output_location_fails_before_the_analysis_and_leaves_nothing(hand: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "afile", "--batch", 2)
    assert rc == 2 and "exists and is not a directory" in err and "…" not in err
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "afile" / "sub", "--batch", 2)
    assert rc == 2 and "cannot write to" in err and "…" not in err
    # an analysis that fails after the folder was made removes the folder it made
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "new", "--tokens", tmp_path / "missing.npy")
    assert rc == 2 and not (tmp_path / "new").exists()
    assert (tmp_path / "afile").read_text() == "x"


def test_an_unwritable_folder_is_found_by_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe write fails as a read-only file system makes it fail (this suite runs as root,
    for whom permission bits do not stop a write); the folder the check made goes again."""

    def read_only(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(QkovError, match="cannot write to .*Read-only file system"):
        with output_folder(tmp_path / "ro", ("index.html",), overwrite=False, what="report"):
            pass
    assert not (tmp_path / "ro").exists()


def test_the_tour_refuses_a_page_it_did_not_write_before_training(tmp_path: Path, capsys) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "index.html").write_text("mine")
    rc, _, err = run_main(capsys, "tour", "--out", tmp_path / "t", "--layers", "0", "--steps", "1")
    assert rc == 2 and "index.html" in err and "not written by qkov" in err
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["index.html"], "nothing trained"
    assert written_by_qkov(tmp_path / "t" / "index.html") is False


# ---------------------------------------------------------------------------------------------
# issue 24, cases 4-6: the check at the moment of replacement, the pair, symlinks

import shutil

import qkov.apps.report as report_app
from qkov.apps.report import collect

REPORT = ("index.html", "report.json")


@pytest.fixture(scope="module")
def hand_report(hand: Path):
    """One real report of the hand-built model, reused by tests that only exercise the writes."""
    return collect(hand, batch=2, icl_examples=2)


def _during_analysis(monkeypatch: pytest.MonkeyPatch, report, act) -> None:
    """Make ``write_report``'s analysis return ``report`` after doing ``act()`` (what a user does meanwhile)."""

    def analysis(*_a: object, **_k: object):
        act()
        return report

    monkeypatch.setattr(report_app, "collect", analysis)


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_case4_a_page_written_during_the_analysis_is_kept(
    hand: Path, hand_report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qkov report M -o X & ...; echo '<html>user</html>' > X/index.html``: the check is repeated
    when the files are replaced, and the report's pair is left whole (neither file replaced)."""
    site = tmp_path / "site"
    _during_analysis(monkeypatch, hand_report, lambda: None)
    write_report(hand, site)
    json_inode = (site / "report.json").stat().st_ino
    user = "<html>user</html>"
    _during_analysis(monkeypatch, hand_report, lambda: (site / "index.html").write_text(user))
    with pytest.raises(QkovError, match=r"index\.html.*not written by qkov") as info:
        write_report(hand, site)
    assert "\n" not in str(info.value)
    assert (site / "index.html").read_text() == user
    assert (site / "report.json").stat().st_ino == json_inode, "report.json was replaced without its page"
    assert _listing(site) == ["index.html", "report.json"], "temporaries left behind"
    # a folder that was empty when the report started: the user's page appears during the analysis
    fresh = tmp_path / "fresh"
    _during_analysis(monkeypatch, hand_report, lambda: (fresh / "index.html").write_text(user))
    with pytest.raises(QkovError, match="not written by qkov"):
        write_report(hand, fresh)
    assert _listing(fresh) == ["index.html"] and (fresh / "index.html").read_text() == user
    # asked to, it is replaced
    write_report(hand, fresh, overwrite=True)
    assert written_by_qkov(fresh / "index.html") and written_by_qkov(fresh / "report.json")
    assert _listing(fresh) == ["index.html", "report.json"]


def test_case4_dynamics_and_tour_repeat_the_check_too(
    hand: Path, hand_report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qkov.apps.dynamics.study as dyn_app
    import qkov.apps.tour as tour_app

    out = tmp_path / "dyn"
    user = "<html>user</html>"

    def measured(*_a: object, **_k: object) -> Any:
        (out / "index.html").write_text(user)
        return SimpleNamespace(to_dict=lambda: {"schema_version": dyn_app.SCHEMA_VERSION, "snapshots": []})

    monkeypatch.setattr(dyn_app, "dynamics", measured)
    monkeypatch.setattr(dyn_app, "render_dynamics", lambda r: '<html><meta name="generator" content="qkov t"></html>')
    with pytest.raises(QkovError, match=r"dynamics: .*index\.html.*not written by qkov"):
        dyn_app.write_dynamics(out, [hand])
    assert _listing(out) == ["index.html"] and (out / "index.html").read_text() == user

    # the tour: a page appears in its folder while it trains and reports
    tour = tmp_path / "tour"
    n = hand_report.card.model["n_layers"]

    def reported(ckpt: Path, folder: Path, **_k: object):
        (tour / "index.html").write_text(user)
        return hand_report

    monkeypatch.setattr(tour_app, "run_state", lambda ckpt: "done")
    monkeypatch.setattr(tour_app, "write_report", reported)
    monkeypatch.setattr(tour_app, "_dynamics", lambda *a: {})
    with pytest.raises(QkovError, match=r"tour: .*index\.html.*not written by qkov"):
        tour_app.run_tour(tour, layers=[n], device="cpu", say=lambda s: None)
    assert _listing(tour) == ["index.html"] and (tour / "index.html").read_text() == user


def _page(marker: str) -> str:
    return f'<!doctype html><html><head><meta name="generator" content="qkov test"></head><body>{marker}</body></html>'


def _title_matches_json(folder: Path) -> bool:
    """The page and report.json describe the same model (each report's title names its model)."""
    name = json.loads((folder / "report.json").read_text())["name"]
    return f"<title>qkov report: {name}</title>" in (folder / "index.html").read_text()


def test_case5_a_report_killed_between_its_two_writes(
    hand: Path, hand_report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report killed at each atomic write (the fault hook ``QKOV_FAULT=kill:N``, in a child
    process) never leaves the page of one model beside the data of another, and the next writer
    removes what the killed one left (a killed write's temporaries were never removed)."""
    import dataclasses

    import qkov.io.atomic as atomic

    out = tmp_path / "out"
    alpha, beta = (dataclasses.replace(hand_report, name=name) for name in ("alpha", "beta"))
    _during_analysis(monkeypatch, alpha, lambda: None)
    write_report(hand, out)
    _during_analysis(monkeypatch, beta, lambda: None)
    codes = []
    for n in (1, 2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                atomic._writes = 0  # the hook counts the child's atomic writes from here
                os.environ["QKOV_FAULT"] = f"kill:{n}"
                write_report(hand, out)
                code = 0
            finally:
                os._exit(code)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        assert codes[-1] in (0, 137)
        assert _title_matches_json(out), f"a mixed pair after a kill at atomic write {n}"
    assert 137 in codes, "the hook killed a write"
    write_report(hand, out)  # the next writer
    assert _listing(out) == ["index.html", "report.json"], "temporaries of killed writes left behind"
    assert json.loads((out / "report.json").read_text())["name"] == "beta" and _title_matches_json(out)


def test_case6_outputs_through_a_symlink_are_refused(hand: Path, tmp_path: Path, capsys) -> None:
    """``ln -s ../victim CKPT/report; qkov report CKPT``: refused, nothing written in victim/."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hand, ckpt)
    victim = tmp_path / "victim"
    victim.mkdir()
    (ckpt / "report").symlink_to("../victim")
    rc, _, err = run_main(capsys, "report", ckpt, "--batch", 2, "--icl-examples", 2, "--quiet")
    assert rc == 2 and "symbolic link" in err and err.strip().count("\n") == 0
    assert _listing(victim) == []
    # a link among the files, pointing at a file or at nothing, is refused too, even with --force
    (victim / "page.html").write_text(_page("theirs"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").symlink_to(victim / "page.html")
    (site / "report.json").symlink_to(victim / "new.json")
    rc, _, err = run_main(capsys, "report", ckpt, "-o", site, "--force", "--quiet")
    assert rc == 2 and "symbolic link" in err and "index.html" in err
    (site / "index.html").unlink()
    rc, _, err = run_main(capsys, "report", ckpt, "-o", site, "--force", "--quiet")
    assert rc == 2 and "symbolic link" in err and "report.json" in err
    assert _listing(victim) == ["page.html"] and (victim / "page.html").read_text() == _page("theirs")
    # the tour's and dynamics' folders too
    (tmp_path / "tour").symlink_to(victim)
    rc, _, err = run_main(capsys, "tour", "--out", tmp_path / "tour", "--layers", "0", "--steps", "1")
    assert rc == 2 and "symbolic link" in err
    rc, _, err = run_main(capsys, "dynamics", ckpt, "-o", tmp_path / "tour")
    assert rc == 2 and "symbolic link" in err
    assert _listing(victim) == ["page.html"]


def test_case6_a_folder_swapped_for_a_link_during_the_analysis_is_refused(
    hand: Path, hand_report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"

    def swap() -> None:
        out.rmdir()
        out.symlink_to(victim)

    _during_analysis(monkeypatch, hand_report, swap)
    with pytest.raises(QkovError, match="symbolic link"):
        write_report(hand, out)
    assert _listing(victim) == []


def _kill_at(k: int, calls: list[str]) -> None:
    """In a forked child: end the process (as SIGKILL does) at its ``k``-th file-system step."""
    import qkov.io.dirfd as fs

    count = [0]

    def step(name: str, fn):
        def wrapped(*a, **kw):
            count[0] += 1
            calls.append(name)
            if count[0] == k:
                os._exit(137)
            return fn(*a, **kw)

        return wrapped

    for name in ("link", "replace", "rename", "unlink", "fsync"):
        setattr(os, name, step(name, getattr(os, name)))
    fs.exchange = step("exchange", fs.exchange)


def _write_killed(folder: Path, files: dict[str, str], k: int) -> int:
    """Run ``replace_pair(folder, files)`` in a child killed at its ``k``-th step; its exit status."""
    from qkov.apps.outputs import replace_pair

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _kill_at(k, [])
            replace_pair(folder, files, overwrite=False, what="report")
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _version(folder: Path) -> str | None:
    """Which write the folder's pair is (the marker both files carry), ``None`` for a mixed pair."""
    page = (folder / "index.html").read_text()
    data = json.loads((folder / "report.json").read_text())["v"]
    return data if f"<body>{data}</body>" in page else None


@pytest.mark.parametrize("start", ["empty", "a report"])
def test_case5_a_pair_write_killed_at_any_step_leaves_one_whole_pair(tmp_path: Path, start: str) -> None:
    """Kill a pair write at each of its file-system steps (every link, rename, exchange, unlink,
    fsync): a reader that settles the folder finds the old pair or the new one, whole, with one
    write id; the next writer leaves no temporary or journal behind."""
    from qkov.apps.outputs import pair_id, replace_pair, settle

    def files(v: str) -> dict[str, str]:
        return {"index.html": _page(v), "report.json": json.dumps({"schema_version": 3, "v": v})}

    seen = set()
    for k in range(1, 100):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        if start != "empty":
            replace_pair(folder, files("old"), overwrite=False, what="report")
        code = _write_killed(folder, files("new"), k)
        if code == 0:
            break
        assert code == 137
        shown = {n for n in _listing(folder) if not n.startswith(".")}
        if shown and (shown != set(REPORT) or _version(folder) is None):
            seen.add("mixed")  # killed between the swaps: detectable before anyone settles it
            assert pair_id(folder, REPORT) is None
        settle(folder, REPORT)
        names = set(_listing(folder))
        assert _version(folder) is not None if names else start == "empty", f"mixed after step {k}"
        if start == "empty" and not names:
            seen.add(None)
        else:
            assert names == set(REPORT), f"kill at step {k}: {sorted(names)}"
            seen.add(_version(folder))
            assert _version(folder) is not None and pair_id(folder, REPORT) is not None, f"mixed after step {k}"
        replace_pair(folder, files("next"), overwrite=False, what="report")
        assert _listing(folder) == sorted(REPORT) and _version(folder) == "next"
    assert code == 0 and k > 6, "the write has several steps to kill it at"
    assert seen == {None if start == "empty" else "old", "new", "mixed"}, "kills before, between and after the swaps"


def test_case4_a_page_saved_in_the_instant_before_the_swap_is_put_back(tmp_path: Path, monkeypatch) -> None:
    """The race itself, made deterministic: the user's page is saved (in place, and by a rename)
    after every check qkov makes and just before the swap; it is found in what the swap
    displaced, put back, and the pair is left as it was."""
    import qkov.apps.outputs as O
    import qkov.io.dirfd as fs

    if fs.RENAMEAT2 is None:
        pytest.skip("no atomic exchange of names on this system")
    folder = tmp_path / "site"
    folder.mkdir()
    O.replace_pair(folder, {"index.html": _page("old"), "report.json": '{"schema_version": 3, "v": "old"}'},
                   overwrite=False, what="report")
    old_json = (folder / "report.json").read_text()
    real = fs.exchange
    user = "<html>user</html>"
    for how in ("in place", "by a rename"):

        raced = []

        def racing(dfd: int, a: str, b: str) -> bool:
            if b == "index.html" and not raced:  # once: the swap, not the swap back
                raced.append(b)
                if how == "in place":
                    (folder / "index.html").write_text(user)
                else:
                    (folder / "mine.html").write_text(user)
                    os.replace(folder / "mine.html", folder / "index.html")
            return real(dfd, a, b)

        monkeypatch.setattr(fs, "exchange", racing)
        with pytest.raises(QkovError, match="index.html.*not written by qkov.*nothing was replaced"):
            O.replace_pair(folder, {"index.html": _page("new"), "report.json": '{"schema_version": 3, "v": "new"}'},
                           overwrite=False, what="report")
        assert (folder / "index.html").read_text() == user, how
        assert (folder / "report.json").read_text() == old_json
        assert _listing(folder) == sorted(REPORT), how
        (folder / "index.html").write_text(_page("old"))


def test_without_an_atomic_exchange_the_pair_is_still_checked_and_replaced(tmp_path: Path, monkeypatch) -> None:
    """Where the file system cannot exchange names, each file is checked just before a plain rename."""
    import qkov.apps.outputs as O
    import qkov.io.dirfd as fs

    def files(v: str) -> dict[str, str]:
        return {"index.html": _page(v), "report.json": json.dumps({"schema_version": 3, "v": v})}

    monkeypatch.setattr(fs, "exchange", lambda *a: False)
    folder = tmp_path / "site"
    folder.mkdir()
    for v in ("one", "two"):
        O.replace_pair(folder, files(v), overwrite=False, what="report")
        assert _version(folder) == v and O.pair_id(folder, REPORT) and _listing(folder) == sorted(REPORT)
    (folder / "report.json").write_text('{"mine": 1}')
    with pytest.raises(QkovError, match="report.json.*not written by qkov"):
        O.replace_pair(folder, files("three"), overwrite=False, what="report")
    assert (folder / "report.json").read_text() == '{"mine": 1}' and _listing(folder) == sorted(REPORT)


def test_a_full_disk_during_a_pair_write_replaces_nothing_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qkov.apps.outputs as O
    import qkov.io.atomic as atomic
    import qkov.io.dirfd as fs

    def files(v: str) -> dict[str, str]:
        return {"index.html": _page(v), "report.json": json.dumps({"schema_version": 3, "v": v})}

    folder = tmp_path / "site"
    folder.mkdir()
    O.replace_pair(folder, files("old"), overwrite=False, what="report")
    real = fs.create

    def second_fails(dfd: int, name: str, data: bytes) -> None:
        if name.startswith(".report.json."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(dfd, name, data)

    monkeypatch.setattr(fs, "create", second_fails)
    with pytest.raises(QkovError, match=r"^report: cannot write to .*No space left on device.*nothing was replaced$"):
        O.replace_pair(folder, files("new"), overwrite=False, what="report")
    assert _listing(folder) == sorted(REPORT) and _version(folder) == "old"
    monkeypatch.setattr(fs, "create", real)
    monkeypatch.setenv("QKOV_FAULT", f"enospc:{atomic._writes + 1}")  # the journal's write
    with pytest.raises(QkovError, match=r"No space left on device.*nothing was replaced"):
        O.replace_pair(folder, files("new"), overwrite=False, what="report")
    assert _listing(folder) == sorted(REPORT) and _version(folder) == "old" and O.pair_id(folder, REPORT)


@pytest.mark.parametrize("failing", [".index.html.", ".report.json."])
def test_a_disk_that_fills_while_a_temporary_is_written_leaves_no_part_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A full disk part way through a temporary (as a 2 MB tmpfs refuses the page after 368 KB of
    it): the part written is removed, nothing is replaced."""
    import qkov.apps.outputs as O

    folder = tmp_path / "site"
    folder.mkdir()
    O.replace_pair(folder, {"index.html": _page("old"), "report.json": '{"schema_version": 3, "v": "old"}'},
                   overwrite=False, what="report")  # fmt: skip
    real = os.fsync

    def full(fd: int) -> None:  # the disk filled part way through the temporary: half of it is there
        if failing in os.readlink(f"/proc/self/fd/{fd}"):
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    new = {"index.html": _page("new" + "x" * 300_000), "report.json": '{"schema_version": 3, "v": "new"}'}
    with pytest.raises(QkovError, match=r"No space left on device.*nothing was replaced"):
        O.replace_pair(folder, new, overwrite=False, what="report")
    assert _listing(folder) == sorted(REPORT) and _version(folder) == "old"


def test_a_reader_finishes_a_pair_killed_between_its_swaps_and_refuses_a_mixed_one(tmp_path: Path) -> None:
    import qkov.apps.outputs as O
    import qkov.io.dirfd as fs

    def files(v: str) -> dict[str, str]:
        return {"index.html": _page(v), "report.json": json.dumps({"schema_version": 3, "v": v})}

    folder = tmp_path / "site"
    folder.mkdir()
    O.replace_pair(folder, files("old"), overwrite=False, what="report")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: killed after the page's swap, before the JSON's
        swaps = []

        def killed(dfd: int, a: str, b: str) -> bool:
            if swaps:
                os._exit(0)
            swaps.append(b)
            return real(dfd, a, b)

        real = fs.exchange
        fs.exchange = killed
        O.replace_pair(folder, files("new"), overwrite=False, what="report")
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert O.pair_id(folder, REPORT) is None and _version(folder) is None  # mixed, as the kill left it
    assert O.read_pair(folder, REPORT, "report.json")["v"] == "new"  # the reader finished the write
    assert _version(folder) == "new" and O.pair_id(folder, REPORT) and _listing(folder) == sorted(REPORT)
    (folder / "index.html").write_text(_page("old").replace("qkov test", "qkov test") + " ")  # a hand edit
    with pytest.raises(QkovError, match="page and report.json are from different writes"):
        O.read_pair(folder, REPORT, "report.json")


def test_a_refused_pair_write_killed_at_any_step_of_its_undo_still_keeps_the_users_page(tmp_path: Path) -> None:
    """The user's page appears in the instant before the swap, so the write is undone; a kill at
    any step after that, in the swaps or in the undo, is settled into the same end: the user's
    page and the old report.json, nothing else in the folder."""
    import qkov.apps.outputs as O
    import qkov.io.dirfd as fs

    user = "<html>user</html>"
    old = {"index.html": _page("old"), "report.json": json.dumps({"schema_version": 3, "v": "old"})}
    new = {"index.html": _page("new"), "report.json": json.dumps({"schema_version": 3, "v": "new"})}
    ends, raced_kills = set(), 0
    for k in range(1, 100):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        O.replace_pair(folder, old, overwrite=False, what="report")
        old_json = (folder / "report.json").read_text()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                real = fs.exchange

                def racing(dfd: int, a: str, b: str) -> bool:
                    if b == "index.html" and not (folder / "raced").exists():
                        (folder / "raced").write_text("")
                        (folder / "index.html").write_text(user)
                    return real(dfd, a, b)

                fs.exchange = racing
                _kill_at(k, [])
                O.replace_pair(folder, new, overwrite=False, what="report")
            except QkovError:
                code = 3
            finally:
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert code in (3, 137), code
        O.settle(folder, REPORT)
        raced = (folder / "raced").exists()
        if raced:
            (folder / "raced").unlink()
        assert _listing(folder) == sorted(REPORT), f"kill at step {k}: {_listing(folder)}"
        if raced:  # the user's page, beside the report.json that was there
            assert (folder / "index.html").read_text() == user, f"kill at step {k}"
            assert (folder / "report.json").read_text() == old_json, f"kill at step {k}"
        else:  # killed before the user saved: a whole pair (a journal in place is rolled forward)
            assert _version(folder) in ("old", "new") and O.pair_id(folder, REPORT), f"kill at step {k}"
        ends.add(raced)
        raced_kills += raced and code == 137
        if code == 3:
            break
    assert code == 3 and ends == {False, True} and raced_kills >= 8, (k, raced_kills)  # the undo has steps
