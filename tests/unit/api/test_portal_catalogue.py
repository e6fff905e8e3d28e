"""The portal's job templates (services/api/portal/catalogue.py): every shipped template makes a spec the API's own
model accepts, the form's values are typed and bounded with errors that name the field, and a broken template file
is refused with its name and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.portal.catalogue import (
    FormError,
    TemplateError,
    load_catalogue,
    parse_template,
    render_spec,
)
from shared.domain import JobSpec


def test_every_shipped_template_makes_a_valid_job_spec_from_its_defaults() -> None:
    catalogue = load_catalogue()
    assert list(catalogue) == ["pytorch-ddp", "ray", "mpi", "notebook"]
    for slug, template in catalogue.items():
        spec = JobSpec.model_validate(render_spec(template, {}, team="team-a", queue="team-a"))
        assert spec.team == "team-a" and spec.labels["portal.gpuq.io/template"] == slug
        assert spec.total_gpus > 0, slug
        assert all(p.template is not None and p.template.image for p in spec.pod_sets), slug


def test_form_values_are_typed_and_bounded() -> None:
    ddp = load_catalogue()["pytorch-ddp"]
    spec = render_spec(ddp, {"name": "run-7", "pods": "4", "gpus_per_pod": "2", "gpu_model": "H100-80GB",
                             "max_runtime": "3", "command": "torchrun 'a b.py' --lr=1e-4"}, team="t", queue="q")
    (workers,) = spec["pod_sets"]
    assert (spec["job_id"], workers["count"], workers["gpus_per_pod"]) == ("run-7", 4, 2)
    assert workers["gpu_models"] == ["H100-80GB"] and spec["max_runtime_s"] == 3 * 3600
    assert workers["template"]["command"] == ["torchrun", "a b.py", "--lr=1e-4"]
    assert render_spec(ddp, {"gpu_model": ""}, team="t", queue="q")["pod_sets"][0]["gpu_models"] == []
    for form, message in (({"pods": "two"}, "Pods: 'two' is not a whole number"),
                          ({"gpus_per_pod": "0"}, "GPUs per pod: 0 is outside 1..64"),
                          ({"name": "Bad Name"}, "Job name: 'Bad Name' is not a valid name"),
                          ({"command": "echo 'unclosed"}, "Command: No closing quotation")):
        with pytest.raises(FormError, match=message):
            render_spec(ddp, form, team="t", queue="q")


@pytest.mark.parametrize(("doc", "reason"), [
    ({"fields": {"name": {"type": "name"}}, "spec": {"kind": "${nope}"}}, "undefined field(s) nope"),
    ({"fields": {"image": {"type": "text"}}, "spec": {}}, "needs a `name` field"),
    ({"fields": {"name": {"type": "name"}}, "spec": {"team": "x"}}, "may not set team, queue or job_id"),
    ({"fields": {"name": {"type": "colour"}}, "spec": {}}, "field 'name' needs a type among"),
    ({"fields": [], "spec": {}}, "a template is a mapping"),
])
def test_a_broken_template_is_refused_naming_the_file_and_the_reason(doc: object, reason: str) -> None:
    with pytest.raises(TemplateError, match=r"^broken\.yaml: .*" + reason.replace("(", r"\(").replace(")", r"\)")):
        parse_template("broken", doc, "broken.yaml")


def test_a_template_file_that_is_not_yaml_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("fields: [unclosed\n")
    with pytest.raises(TemplateError, match=r"^bad\.yaml: not YAML"):
        load_catalogue(tmp_path)
