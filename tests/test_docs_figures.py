"""The docs' measured figures cannot drift from their raw files: every generated block
regenerates to what the docs hold, and every other table of numbers links the raw file it
came from."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.errors import BadInputError
from hpcdl.figures import CLOSE, OPEN, blocks, doc_files, regenerate

ROOT = Path(__file__).resolve().parents[1]
#: A raw file is linked when a row of the table, or its caption (the lines just above it
#: up to the previous table or heading), links into docs/results/.
RAW_LINK = re.compile(r"\]\((?:\.\./)?(?:docs/)?results/[^)]+\)")
CAPTION_LINES = 12
#: A table of settings, not measurements, says so in a comment on the line above it.
NOT_MEASURED = "<!-- not measured: "


def test_every_generated_block_matches_its_raw_files():
    assert regenerate(ROOT, doc_files(ROOT), write=False) == [], \
        "run: python3 -m hpcdl.cli.main bench report --docs"


def test_the_docs_hold_a_generated_block_for_each_builder():
    from hpcdl.figures.tables import TABLES

    found = {b.name for path in doc_files(ROOT) for b in blocks(path)}
    assert found == set(TABLES)


def _copy_with_edit(tmp_path: Path, old: str, new: str, name: str = "performance.md") -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results").symlink_to(ROOT / "docs" / "results")
    doc = tmp_path / "docs" / name
    text = (ROOT / "docs" / name).read_text()
    assert old in text
    doc.write_text(text.replace(old, new, 1))
    return doc


def test_a_figure_edited_by_hand_fails_the_check(tmp_path):
    # the per-host byte ratio of hierarchical local SGD, rounded up by hand
    doc = _copy_with_edit(tmp_path, "| 4.44 / 3.86 |", "| 4.44 / 4.00 |")
    assert regenerate(tmp_path, [doc], write=False) == ["docs/performance.md: relaxed-network"]
    regenerate(tmp_path, [doc], write=True)
    assert "| 4.44 / 3.86 |" in doc.read_text()


def test_a_checkpoint_cost_figure_edited_by_hand_fails_the_check(tmp_path):
    # scaling.md's 2,048-rank extrapolation is the bench's, read from its JSON
    doc = _copy_with_edit(tmp_path, "| 205.2 MB | 489.3 MB |", "| 205.0 MB | 489.3 MB |",
                          "scaling.md")
    assert regenerate(tmp_path, [doc], write=False) == ["docs/scaling.md: checkpoint-cost"]


def test_a_summary_cell_edited_by_hand_fails_the_check(tmp_path):
    # the summary at the top of performance.md is generated from the same raw files
    doc = _copy_with_edit(tmp_path, "4.44× / 3.86× fewer bytes", "4.44× / 4.10× fewer bytes")
    assert regenerate(tmp_path, [doc], write=False) == ["docs/performance.md: summary"]


def test_the_summary_quotes_its_sections_tables():
    # one function per figure: the summary's cells are the figures its sections' tables show
    text = (ROOT / "docs" / "performance.md").read_text()
    summary = text.split("<!-- generated: summary", 1)[1].split(CLOSE, 1)[0]
    for figure in ("0.960 [0.927–0.996]", "| 4.44 / 3.86 | 4.14 |", "**2.01×** / **1.54×**",
                   "**1.03 [1.03–1.03]**", "**−0.14**", "**1.056 [0.966–1.057]**", "**10 of 12**"):
        assert figure in text.replace(summary, ""), figure
    for figure in ("0.960", "4.44× / 3.86×", "2.01× / 1.54×", "1.03 [1.03–1.03]", "−0.14",
                   "fp32 1.06×", "10 of 12"):
        assert figure in summary, figure


def test_a_block_without_its_end_marker_is_bad_input(tmp_path):
    doc = _copy_with_edit(tmp_path, CLOSE, "")
    with pytest.raises(BadInputError, match="performance.md:.*no '<!-- end generated -->'"):
        regenerate(tmp_path, [doc], write=False)


def test_a_missing_raw_file_is_bad_input_naming_the_block(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    doc = tmp_path / "docs" / "performance.md"
    doc.write_text("<!-- generated: loader -->\n<!-- end generated -->\n")
    with pytest.raises(BadInputError, match="block 'loader' cannot be built from "
                                            "docs/results/loader-fair-baselines"):
        regenerate(tmp_path, [doc], write=False)


def test_the_report_command_checks_the_docs_and_prints_how_ratios_are_computed():
    done = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "bench", "report", "--docs",
                           "--check", "--root", str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "relaxed-network: bytes each host's eth0 sent" in done.stdout
    assert "0 block(s) differ from their raw files" in done.stdout


def tables_outside_blocks(path: Path) -> list[tuple[int, list[str], list[str]]]:
    """(first line number, caption lines, table lines) of every Markdown table of ``path``
    that no generated block holds."""
    lines = path.read_text().splitlines()
    inside = set()
    for block in blocks(path):
        inside.update(range(block.start, block.end + 1))
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i not in inside:
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            k = i
            while k > 0 and i - k < CAPTION_LINES and not lines[k - 1].startswith(("|", "#")) \
                    and not OPEN.match(lines[k - 1].strip()) and lines[k - 1].strip() != CLOSE:
                k -= 1
            found.append((i + 1, lines[k:i], lines[i:j]))
            i = j
        else:
            i += 1
    return found


def measured(row: str) -> bool:
    """A data row holding a measured-looking number (a decimal, or a figure with a unit)."""
    cells = [VERSION_OR_CODE.sub("", c) for c in row.strip("|").split("|")]
    return any(re.search(r"\d\.\d|\d\s*(?:%|s\b|ms|MB|GB|img/s|×)", c) for c in cells[1:])


#: versions (5.0.2) and code spans name things; they are not figures
VERSION_OR_CODE = re.compile(r"`[^`]*`|\d+\.\d+\.\d+")


#: every doc but the notebooks of docs/results/ (superseded runs, kept verbatim as history)
MEASURED_DOCS = ("README.md", *sorted(str(p.relative_to(ROOT))
                                      for p in (ROOT / "docs").glob("*.md")))


@pytest.mark.parametrize("doc", MEASURED_DOCS)
def test_every_measured_table_is_generated_or_links_its_raw_file(doc):
    unlinked = []
    for line, caption, table in tables_outside_blocks(ROOT / doc):
        rows = table[2:]
        if not any(measured(r) for r in rows) or (caption and caption[-1].startswith(NOT_MEASURED)):
            continue
        if not any(RAW_LINK.search(t) for t in caption + table):
            unlinked.append(f"{doc}:{line}: {table[0][:70]}")
    assert unlinked == [], "generate these from docs/results/ or link the raw file:\n" + \
        "\n".join(unlinked)


def test_the_check_reads_a_copy_not_the_tree(tmp_path):
    # guards the edit test above: it must not rewrite the repository's own docs
    before = (ROOT / "docs" / "performance.md").read_text()
    doc = _copy_with_edit(tmp_path, "| 4.44 / 3.86 |", "| 9.99 / 3.86 |")
    regenerate(tmp_path, [doc], write=True)
    assert (ROOT / "docs" / "performance.md").read_text() == before
    shutil.rmtree(tmp_path / "docs")


#: a figure in prose: a number with two or more decimals (one-decimal and whole numbers are
#: mostly settings and sizes, which this check leaves alone)
PROSE_FIGURE = re.compile(r"(?<![\w.`/-])[−-]?\d+\.\d{2,}(?![\w.])")
#: performance.md's prose figures that no generated block shows, each with where it comes from
NOT_IN_A_BLOCK = {
    "0.09": "the largest gap between a bucket size's two runs (the bucket table)",
    "0.02": "η (a setting); the window-1 rows' distance outside the band (its column)",
    "0.004": "η tried before the study (a setting)",
    "0.01": "η tried before the study (a setting)",
    "0.81": "bf16's seed range (the bf16 accuracy table)",
    "0.07": "fp32's seed range (the bf16 accuracy table)",
    "0.62": "the two SGD policies' holdout gap at 1,536 (the holdout column)",
    "4.67": "same-policy SGD's holdout minus its final at 1,536 (the convergence table)",
    "3.92": "a superseded headline (notebook)",
    "2.96": "a superseded headline (notebook)",
    "0.400": "window 1's prediction, `predicted_step_s` of its JSON",
    "0.937": "the calibrated bandwidth over the tbf rate (cal2gbit JSON)",
    "0.620": "elastic-resume top-1 (its JSON)",
}


def prose_figures(path: Path) -> list[tuple[int, str]]:
    """(line, figure) of each prose figure outside generated blocks, tables and code."""
    lines = path.read_text().splitlines()
    inside = {i for b in blocks(path) for i in range(b.start, b.end + 1)}
    found, code = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            code = not code
        elif not (code or i in inside or line.startswith("|")):
            found += [(i + 1, m) for m in PROSE_FIGURE.findall(re.sub(r"`[^`]*`", "", line))]
    return found


def stray_prose_figures(path: Path) -> list[str]:
    """Prose figures of ``path`` that no generated block of it shows and NOT_IN_A_BLOCK does
    not account for."""
    lines = path.read_text().splitlines()
    generated = "\n".join(line for b in blocks(path) for line in lines[b.start:b.end + 1])
    return [f"{path.name}:{n}: {fig}" for n, fig in prose_figures(path)
            if fig not in generated and fig not in NOT_IN_A_BLOCK]


def test_performance_prose_quotes_only_figures_its_generated_blocks_show():
    stray = stray_prose_figures(ROOT / "docs" / "performance.md")
    assert stray == [], "quote the generated table, or say where it comes from:\n" + \
        "\n".join(stray)


def test_a_prose_figure_edited_by_hand_fails_the_prose_check(tmp_path):
    # a figure restated in prose and then edited by hand no longer matches any block
    doc = _copy_with_edit(tmp_path, "4.44× (h1) and 3.86× (h2)", "4.44× (h1) and 3.91× (h2)")
    assert [s.split(": ")[-1] for s in stray_prose_figures(doc)] == ["3.91"]


def _step_report(precision: str, layout: str, ours: float, plain: float) -> dict:
    """A `hpcdl bench train --modes no_comm,torch` JSON reduced to what the bf16 table reads."""
    def record(mode, images_per_s):
        return {"mode": mode, "precision": precision, "memory_format": layout, "threads": 2,
                "images_per_s_per_rank": images_per_s, "vs_torch": images_per_s / plain,
                "flops_fraction_of_matmul": images_per_s / 200, "cpu_s_per_step": 32 / images_per_s,
                "cpu_flops_fraction_of_matmul": images_per_s / 100}
    return {"results": [record("no_comm", ours), record("torch", plain)],
            "ratios": {"matmul_gflops_per_cpu_s_per_rank": 400.0},
            "compute_breakdown": {"convolution_share": 0.6},
            "machine": {"cpu": "Some Xeon", "cores": 2, "cpu_capability": "AVX512",
                        "bf16_native": True, "threads_per_rank": 2,
                        "load_average": {"before": [3.0, 0, 0], "after": [4.0, 0, 0]}}}


def test_the_bf16_table_sets_each_dtype_beside_plain_torch_in_the_layout_auto_picks(tmp_path):
    import json

    from hpcdl.figures import tables

    folder = tmp_path / "docs" / "results" / tables.BF16_SPEED_DIR
    folder.mkdir(parents=True)
    for prefix, _ in tables.BF16_SPEED_MODELS:
        for name, report in (("fp32", _step_report("float32", "contiguous", 10.0, 10.0)),
                             ("bf16", _step_report("bfloat16", "channels_last", 25.0, 20.0))):
            (folder / f"{prefix}-{name}-1.json").write_text(json.dumps(report))
        slow = _step_report("bfloat16", "contiguous", 20.0, 20.0)
        (folder / f"layout-{prefix}-bf16-contiguous.json").write_text(json.dumps(slow))
    text = tables.bf16_speed_of(tmp_path, tables.BF16_SPEED_DIR)
    assert "`lscpu` \"Some Xeon\"" in text
    rows = [line for line in text.splitlines() if line.startswith("| ResNet-50")]
    assert [r.split(" | ")[1:3] for r in rows] == [
        ["fp32", "contiguous (auto)"], ["bf16", "channels_last (auto)"], ["bf16", "contiguous"]]
    assert "| **1.25 [1.25–1.25]** |" in rows[1]           # hpcdl ÷ torch, each run's own
    assert "auto picks: **2.50×** / **2.50×**" in text      # bf16 ÷ fp32, auto layouts only
    assert tables.bf16_vs_torch(tmp_path, "resnet50-112px-b32") == ([1.25], 0.25)
