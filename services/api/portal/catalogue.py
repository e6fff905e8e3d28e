"""The portal's job templates: YAML files (job_templates/*.yaml), each a form's fields and the JobSpec they fill.

A template is data, not code: adding one is adding a file (docs/portal.md). What a filled template
becomes is a plain job spec, which the portal submits through POST /v1/jobs, where it is validated and judged as
any other submission; nothing here decides whether a job is acceptable beyond the form's own types and bounds.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TEMPLATES_DIR = Path(__file__).parent / "job_templates"
FIELD_TYPES = ("name", "text", "int", "hours", "command", "gpu_model")
_PLACEHOLDER = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,126}[a-z0-9])?$")  # shared.domain's NAME_RE: a job id the form offers


class TemplateError(ValueError):
    """A template file that is not a valid template (the message names the file and what is wrong)."""


class FormError(ValueError):
    """A form value the template's field refuses (the message names the field)."""


@dataclass(frozen=True)
class Field:
    key: str
    label: str
    type: str
    default: str | int
    min: int | None = None
    max: int | None = None


@dataclass(frozen=True)
class JobTemplate:
    slug: str  # the file's name without .yaml: its URL
    title: str
    description: str
    order: int
    fields: tuple[Field, ...]
    spec: Mapping[str, Any]

    def defaults(self) -> dict[str, str]:
        return {f.key: str(f.default) for f in self.fields}


def parse_template(slug: str, doc: Any, where: str) -> JobTemplate:
    """A template from its YAML document; TemplateError saying what is wrong with it."""
    if not _SLUG.match(slug):
        raise TemplateError(f"{where}: the file name must be lower-case letters, digits and '-'")
    if not isinstance(doc, dict) or not isinstance(doc.get("fields"), dict) or not isinstance(doc.get("spec"), dict):
        raise TemplateError(f"{where}: a template is a mapping with `title`, `fields` (a mapping) and `spec`")
    fields = []
    for key, f in doc["fields"].items():
        if not isinstance(f, dict) or f.get("type", "text") not in FIELD_TYPES:
            raise TemplateError(f"{where}: field {key!r} needs a type among {', '.join(FIELD_TYPES)}")
        kind = f.get("type", "text")
        default = f.get("default", 0 if kind in ("int", "hours") else "")
        fields.append(Field(key=str(key), label=str(f.get("label", key)), type=kind, default=default,
                            min=f.get("min"), max=f.get("max")))
    keys = {f.key for f in fields}
    used = set(_PLACEHOLDER.findall(yaml.safe_dump(doc["spec"])))
    if used - keys:
        raise TemplateError(f"{where}: spec uses undefined field(s) {', '.join(sorted(used - keys))}")
    if "name" not in keys:
        raise TemplateError(f"{where}: a template needs a `name` field (the job's id)")
    if {"team", "queue", "job_id"} & set(doc["spec"]):
        raise TemplateError(f"{where}: spec may not set team, queue or job_id (the portal sets them)")
    return JobTemplate(slug=slug, title=str(doc.get("title", slug)), description=str(doc.get("description", "")),
                       order=int(doc.get("order", 100)), fields=tuple(fields), spec=doc["spec"])


def load_catalogue(directory: Path = TEMPLATES_DIR) -> dict[str, JobTemplate]:
    """Every template of `directory`, in catalogue order."""
    found = []
    for path in sorted(directory.glob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise TemplateError(f"{path.name}: not YAML: {exc}") from None
        found.append(parse_template(path.stem, doc, path.name))
    return {t.slug: t for t in sorted(found, key=lambda t: (t.order, t.slug))}


def field_values(template: JobTemplate, form: Mapping[str, str]) -> dict[str, Any]:
    """The form's values typed by their fields (a missing one takes its default); FormError for the first bad one."""
    values: dict[str, Any] = {}
    for f in template.fields:
        raw = str(form.get(f.key, f.default)).strip()
        if f.type in ("int", "hours"):
            try:
                n = int(raw)
            except ValueError:
                raise FormError(f"{f.label}: {raw!r} is not a whole number") from None
            if (f.min is not None and n < f.min) or (f.max is not None and n > f.max):
                raise FormError(f"{f.label}: {n} is outside {f.min}..{f.max}")
            values[f.key] = n * 3600 if f.type == "hours" else n
        elif f.type == "command":
            try:
                values[f.key] = shlex.split(raw)
            except ValueError as exc:
                raise FormError(f"{f.label}: {exc}") from None
        elif f.type == "gpu_model":
            values[f.key] = [raw] if raw else []  # none: any model
        elif f.type == "name":
            if not _NAME.match(raw):
                raise FormError(f"{f.label}: {raw!r} is not a valid name (lower-case letters, digits, '.', '_', '-')")
            values[f.key] = raw
        else:
            if not raw:
                raise FormError(f"{f.label}: required")
            values[f.key] = raw
    return values


def render_spec(template: JobTemplate, form: Mapping[str, str], *, team: str, queue: str) -> dict[str, Any]:
    """The job spec the filled form asks for (a JSON-able dict, the body of POST /v1/jobs)."""
    values = field_values(template, form)
    spec = _fill(template.spec, values)
    return {"job_id": values["name"], "team": team, "queue": queue, **spec}


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    if isinstance(node, str):
        whole = _PLACEHOLDER.fullmatch(node)
        if whole:
            return values[whole.group(1)]
        return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), node)
    return node


def spec_yaml(spec: Mapping[str, Any]) -> str:
    """The spec as `gpuq submit FILE` reads it (what the preview shows)."""
    return yaml.safe_dump(dict(spec), sort_keys=False, default_flow_style=False)
