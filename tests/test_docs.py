"""The docs that must stay true as the code changes: the module map of docs/architecture.md, the
README's settings table, and the benchmark pages that bench/report.py generates from bench/results/*.json."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = (ROOT / "service" / "quantd", ROOT / "client" / "quantd_client")


def module_map_section(text: str) -> str:
    """The text under the ``## Module map`` heading, up to the next ``## `` heading."""
    match = re.search(r"^## Module map\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, "docs/architecture.md has no '## Module map' section"
    return match.group(1)


def mapped_modules(text: str) -> set[str]:
    """Paths named in the first column of the module map's table."""
    return {
        m.group(1)
        for line in module_map_section(text).splitlines()
        if (m := re.match(r"^\|\s*`([^`]+\.py)`\s*\|", line))
    }


def source_modules() -> set[str]:
    """Every module of the two packages but the ``__init__.py`` files."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in package.rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def test_module_map_lists_every_module_and_nothing_else() -> None:
    mapped = mapped_modules(ARCHITECTURE.read_text(encoding="utf-8"))
    modules = source_modules()
    missing = sorted(modules - mapped)
    stale = sorted(mapped - modules)
    assert not missing, f"add these modules to the module map of docs/architecture.md: {missing}"
    assert not stale, f"the module map of docs/architecture.md names modules that do not exist: {stale}"


def test_module_map_parser_sees_additions_and_removals() -> None:
    text = (
        "# x\n\n## Module map\n\n| module | what |\n|---|---|\n"
        "| `service/quantd/a.py` | a |\n| `client/quantd_client/_b.py` | b |\n\n"
        "## Next\n\n| `service/quantd/not_in_map.py` | elsewhere |\n"
    )
    assert mapped_modules(text) == {"service/quantd/a.py", "client/quantd_client/_b.py"}


def test_readme_lists_every_setting() -> None:
    from quantd.server.settings import Settings

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [f"QUANTD_{name.upper()}" for name in Settings.model_fields if f"`QUANTD_{name.upper()}`" not in readme]
    assert not missing, f"add these settings to the README's settings table: {missing}"


def test_benchmark_pages_match_the_results_files() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "report.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_report_check_sees_a_page_that_differs_from_the_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "bench"))
    doc, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    doc.write_text(report.benchmarks_page(), encoding="utf-8")
    readme.write_text(report.splice_readme((ROOT / "README.md").read_text(encoding="utf-8"), report.readme_block()), encoding="utf-8")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "DOC", doc)
    monkeypatch.setattr(report, "README", readme)
    assert report.main(["--check"]) == 0
    readme.write_text(readme.read_text(encoding="utf-8").replace("| int8", "| int9", 1), encoding="utf-8")
    assert report.main(["--check"]) == 1
    readme.write_text(report.splice_readme((ROOT / "README.md").read_text(encoding="utf-8"), report.readme_block()), encoding="utf-8")
    doc.write_text(doc.read_text(encoding="utf-8") + "typed by hand\n", encoding="utf-8")
    assert report.main(["--check"]) == 1


@pytest.mark.slow
def test_the_readme_sdk_example_passes_mypy_strict_without_plugins(tmp_path: Path) -> None:
    """A user's type checker sees the SDK's models as plain dataclass-like classes (no pydantic plugin): the
    README's example must type-check as written."""
    pytest.importorskip("mypy")
    block = (ROOT / "README.md").read_text().split("## Python SDK", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "example.py").write_text(block)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    env = {**os.environ, "MYPYPATH": str(ROOT / "client")}
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file",
                           str(tmp_path / "mypy.ini"), str(tmp_path / "example.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
