"""docs/configuration.md is generated from the config tree (pipeline/config_docs.py) and is
current: a field added, renamed or documented anew without regenerating the page fails here."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pipeline.config import Config
from pipeline.config_docs import PAGE, render, section_model, sections

pytestmark = pytest.mark.ray_free


def test_the_configuration_page_is_current():
    assert PAGE.read_text() == render(), (
        f"{PAGE} is stale: run `python -m pipeline.config_docs` and commit it"
    )


def test_every_field_has_a_row_with_its_docstring():
    page = render()
    fields = [
        (path, name, f)
        for path, model in sections(Config)
        for name, f in model.model_fields.items()
        if section_model(f.annotation) is not f.annotation
    ]
    assert len(fields) > 80  # the whole tree, nested sections included
    for path, name, f in fields:
        assert f.description, f"{path}.{name} has no docstring: it is the documentation"
        assert f"| `{name}` |" in page and " ".join(f.description.split())[:60] in page, name
    for path, _ in sections(Config)[1:]:
        assert f"\n## `{path}:`\n" in page
