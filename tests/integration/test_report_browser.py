"""``raymesh report``'s page as a browser shows it: headless Chromium (Debian's ``chromium``, which .ci/run
installs) loads ``index.html``, every chart image decodes, and the screenshot has the charts painted where the
page lays them out. No Ray: the run dir is the synthetic one the report's unit tests use."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from orchestrator.observability.report import write_report
from tests.support.report_runs import make_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDTH, HEIGHT = 1100, 6000
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
         f"--window-size={WIDTH},{HEIGHT}", "--allow-file-access-from-files", "--virtual-time-budget=10000"]
# A page beside the report that loads it in a frame the size of the screenshot and lists, once it has loaded
# (images included), each image's decoded size and its box in the frame's coordinates.
PROBE = f"""<!doctype html><html><body style="margin:0">
<iframe id="page" src="index.html" style="border:0;width:{WIDTH}px;height:{HEIGHT}px"></iframe>
<script>
document.getElementById("page").addEventListener("load", () => {{
  const doc = document.getElementById("page").contentDocument;
  const images = [...doc.images].map(i => {{
    const r = i.getBoundingClientRect();
    return {{src: i.getAttribute("src"), complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
             box: [r.left, r.top, r.right, r.bottom]}};
  }});
  const out = document.createElement("pre");
  out.id = "images";
  out.textContent = JSON.stringify(images);
  document.body.appendChild(out);
}});
</script></body></html>"""


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert Path(CHROMIUM).exists(), "headless Chromium is needed: apt-get install chromium (as .ci/run does)"
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=120)


def images_in_browser(report_dir: Path) -> list[dict]:
    (report_dir / "probe.html").write_text(PROBE)
    proc = chromium("--dump-dom", (report_dir / "probe.html").as_uri())
    found = re.search(r'<pre id="images">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"the probe page did not report: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def screenshot(report_dir: Path, out: Path) -> np.ndarray:
    chromium(f"--screenshot={out}", (report_dir / "index.html").as_uri())
    return imread(out)[..., :3]


def painted(shot: np.ndarray, box: list[float]) -> tuple[float, int]:
    """Within ``box``: the share of pixels that are not white, and how many distinct colours there are."""
    left, top, right, bottom = (round(v) for v in box)
    region = shot[top:bottom, left:right]
    assert region.size, f"chart box {box} lies outside the {WIDTH}x{HEIGHT} screenshot"
    not_white = (region < 0.97).any(axis=-1).mean()
    colours = len(np.unique((region * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    return float(not_white), colours


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return write_report(make_run(tmp_path_factory.mktemp("browser") / "run"))


def test_every_chart_loads_and_is_painted_where_the_page_puts_it(report, tmp_path):
    report_dir = Path(report["html"]).parent
    images = images_in_browser(report_dir)
    assert sorted(i["src"] for i in images) == sorted(Path(p).name for p in report["pngs"])
    for image in images:
        assert image["complete"] and image["width"] > 300 and image["height"] > 200, image  # decoded
    shot = screenshot(report_dir, tmp_path / "page.png")
    for image in images:
        share, colours = painted(shot, image["box"])
        assert share > 0.03 and colours > 20, (image["src"], share, colours)  # a chart, not a blank box


def test_a_chart_that_does_not_load_is_caught(report, tmp_path):
    """The same page with one PNG gone: the browser reports it undecoded (so the test above can fail)."""
    broken = tmp_path / "report"
    shutil.copytree(Path(report["html"]).parent, broken)
    missing = Path(report["pngs"][0]).name
    (broken / missing).unlink()
    by_src = {i["src"]: i for i in images_in_browser(broken)}
    assert by_src[missing]["width"] == 0
    assert all(i["width"] > 0 for src, i in by_src.items() if src != missing)
