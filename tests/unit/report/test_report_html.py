"""The HTML report: self-contained, written by `autopar show`, and rendered by headless Chromium
(where the machine has it: `apt-get install chromium`; skipped otherwise)."""

import re
import shutil
import subprocess

import numpy as np
import pytest

from autopar.cli import main
from autopar.report.draw import PASS_COLORS
from autopar.report.html import report_html
from report_plans import evaluated, searched

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    plan = searched()
    path = tmp_path_factory.mktemp("report") / "plan.json"
    plan.save(path)
    return plan, path


def test_report_is_one_self_contained_page(report):
    plan, _ = report
    page = report_html(plan)
    for element in ('id="summary"', 'id="timeline"', 'id="memory"', 'id="alternatives"'):
        assert element in page
    # nothing to fetch: every src/href is inline data, no scripts or stylesheets from elsewhere
    assert not re.search(r'(?:src|href)="(?!data:)', page)
    assert "<script" not in page and "<link" not in page
    assert plan.search["runners_up"][0]["config"] in page


def test_show_writes_the_pictures_it_is_asked_for(report, tmp_path, capsys):
    _, path = report
    timeline, memory, page = tmp_path / "t.html", tmp_path / "m.png", tmp_path / "r.html"
    assert main(["show", str(path), "--timeline", str(timeline), "--memory", str(memory), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 3 and "predicted" in out
    assert memory.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'id="timeline"' in timeline.read_text()


@pytest.mark.parametrize("argv, fragment", [(["--timeline", "t.jpg"], "unknown picture format"),
                                            (["--memory", "m.html"], "unknown picture format"),
                                            (["--memory", "/no/such/dir/m.png"], "cannot write")])
def test_show_refuses_what_it_cannot_write(report, capsys, argv, fragment):
    _, path = report
    assert main(["show", str(path)] + argv) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_chromium_renders_the_report_offline(tmp_path):
    plan = evaluated(pp=2, schedule="interleaved", virtual_stages=2, recompute="full")
    page = tmp_path / "report.html"
    page.write_text(report_html(plan))
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1400,1800"]
    shot = tmp_path / "shot.png"
    # one launch: the screenshot, and the DOM as Chromium parsed it on stdout
    dom = subprocess.run(flags + [f"--screenshot={shot}", "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    for element in ('id="summary"', 'id="timeline"', 'id="memory"', 'id="alternatives"'):
        assert element in dom
    from matplotlib.image import imread

    pixels = (imread(shot)[..., :3] * 255).astype(int)
    for kind in ("forward", "backward", "recompute"):
        color = np.array([int(PASS_COLORS[kind][0][i:i + 2], 16) for i in (1, 3, 5)])
        near = np.abs(pixels - color).sum(axis=-1) < 24
        assert near.sum() > 200, f"no {kind} blocks visible in the rendered report"
