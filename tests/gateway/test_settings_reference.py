"""docs/settings.md is the settings classes' own reference: complete, current, one area per field."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from app.service.settings import AREAS, Settings
from app.service.settings import reference


def test_reference_page_is_current():
    written = reference.REFERENCE_PATH.read_text(encoding="utf-8")
    assert written == reference.render(), "docs/settings.md is stale: run python -m app.service.settings.reference"


def test_every_setting_has_one_area_and_a_description():
    assert reference.problems() == []
    in_areas = [name for area in AREAS for name in area.model_fields]
    assert sorted(in_areas) == sorted(Settings.model_fields)


def test_every_variable_is_listed_once_under_its_area():
    page = reference.render()
    for area in AREAS:
        section = page.split(f"\n## {area.__module__.rsplit('.', 1)[-1]}\n", 1)[1].split("\n## ", 1)[0]
        for name in area.model_fields:
            assert page.count(f"| `HYPIC_{name.upper()}` |") == 1, name
            assert f"| `HYPIC_{name.upper()}` |" in section, (name, area.__name__)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("cache_memory_bytes", 2 << 30, "2147483648 (2 GiB)"),
    ("max_header_bytes", 16 << 10, "16384 (16 KiB)"),
    ("max_stop_bytes", 1000, "1000"),
    ("max_running", 8, "8"),
    ("model_name", None, "unset"),
    ("api_key", SecretStr("x"), "(secret)"),
    ("exact_repeats", False, "false"),
    ("cors_origins", ["http://a"], '["http://a"]'),
])
def test_default_rendering(field, value, shown):
    assert reference.render_default(field, value) == shown


def test_check_mode_flags_a_stale_page(tmp_path, capsys):
    page = tmp_path / "settings.md"
    page.write_text(reference.render().replace("HYPIC_PORT", "HYPIC_PORTS"), encoding="utf-8")
    assert reference.main(["--check", "--out", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
    assert reference.main(["--out", str(page)]) == 0
    assert reference.main(["--check", "--out", str(page)]) == 0
