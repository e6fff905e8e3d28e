"""requirements.lock, the image's dependencies (`make lock`; the Dockerfile installs it with --require-hashes): it
pins every runtime dependency of pyproject.toml (and the extras they ask for) at a version their specifiers allow,
every pin carries hashes, nothing of the simulator's extra is in it, and the Dockerfile installs exactly it."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
# The image's platform (Dockerfile: python:3.11-slim-bookworm; amd64 and arm64 resolve alike).
IMAGE_ENV = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.16",
             "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython"}


@dataclass(frozen=True)
class Pin:
    version: Version
    hashes: tuple[str, ...]
    marker: str


def parse_lock(text: str) -> dict[str, Pin]:
    """name -> its pin, from pip's requirements format as `uv pip compile --generate-hashes` writes it."""
    pins: dict[str, Pin] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", "\n".join(line for line in text.splitlines()
                                                        if not line.lstrip().startswith("#")))
    for entry in entries:
        entry = entry.replace("\\\n", " ").strip()
        if not entry:
            continue
        head, *options = (part.strip() for part in entry.split(" --"))
        req = Requirement(head.strip())
        (spec,) = req.specifier
        assert spec.operator == "==", f"{head}: a lock pins with == only"
        hashes = tuple(o.removeprefix("hash=") for o in options if o.startswith("hash="))
        assert len(hashes) == len(options), f"{req.name}: only --hash options belong in the lock: {options}"
        pins[canonicalize_name(req.name)] = Pin(Version(spec.version), hashes, str(req.marker or ""))
    return pins


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def unmet(requirements: list[Requirement], pins: dict[str, Pin]) -> list[str]:
    """What of `requirements` (those that apply to the image) the pins leave out or pin at a version they refuse."""
    out = []
    for req in requirements:
        if req.marker is not None and not any(req.marker.evaluate({**IMAGE_ENV, "extra": e})
                                              for e in ("", *sorted(req.extras))):
            continue
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            out.append(f"{req} is not in the lock")
        elif not req.specifier.contains(pin.version, prereleases=True):
            out.append(f"{req} refuses the locked {req.name}=={pin.version}")
    return out


def test_the_lock_pins_every_runtime_dependency_at_an_allowed_version_with_hashes() -> None:
    pins = parse_lock(LOCK.read_text())
    assert pins, "requirements.lock holds no pin"
    assert not unmet(runtime_requirements(), pins)
    for name, pin in pins.items():
        assert pin.hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in pin.hashes), name
    # The slim image: none of the simulator's extra.
    sim = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sim"]
    assert not {canonicalize_name(Requirement(r).name) for r in sim} & pins.keys()


def test_the_lock_is_closed_under_what_its_packages_require() -> None:
    """Each locked package's own requirements (with the extras pyproject asks of it) are locked too, as pip's
    --require-hashes demands at build time. Read from the installed metadata of the packages installed at their
    locked version (`make install` resolves the same versions; the others are checked when they match again)."""
    pins = parse_lock(LOCK.read_text())
    extras: dict[str, set[str]] = {}
    for req in runtime_requirements():
        extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    checked, problems = 0, []
    for name, pin in sorted(pins.items()):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version) != pin.version:
            continue
        checked += 1
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not any(req.marker.evaluate({**IMAGE_ENV, "extra": e})
                                                  for e in ("", *sorted(extras.get(name, ())))):
                continue
            problems += [f"{name}: {p}" for p in unmet([Requirement(str(req).split(";")[0])], pins)]
    assert checked >= len(pins) // 2, f"only {checked} of {len(pins)} locked packages are installed at their version"
    assert not problems


def test_an_unmet_or_unhashed_dependency_is_found() -> None:
    """The checks above have teeth: a pin the specifier refuses, a dependency left out, a pin without hashes."""
    text = LOCK.read_text()
    pins = parse_lock(text)
    pydantic = pins["pydantic"]
    assert unmet([Requirement("pydantic>=2.6")], {**pins, "pydantic": Pin(Version("1.10.0"), pydantic.hashes, "")})
    assert unmet([Requirement("pydantic>=2.6")], {k: v for k, v in pins.items() if k != "pydantic"})
    unhashed = re.sub(r"^(pyyaml==\S+) \\\n(    --hash=\S+(?: \\)?\n)+", r"\1\n", text, flags=re.MULTILINE)
    assert unhashed != text and not parse_lock(unhashed)["pyyaml"].hashes


def test_the_image_installs_the_lock_with_hashes_then_gpuq_without_dependencies() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip install [^\n]*--require-hashes [^\n]*-r requirements\.lock", dockerfile)
    assert re.search(r"pip install [^\n]*--no-deps /dist/gpuq-\*\.whl", dockerfile)
    assert "COPY requirements.lock" in dockerfile
    assert "!requirements.lock" in (ROOT / ".dockerignore").read_text().splitlines()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs and not any("[" in line for line in installs)  # no extra in the image
    makefile = (ROOT / "Makefile").read_text()
    lock_rule = makefile[makefile.index("\nlock:"):]
    assert "--generate-hashes" in lock_rule and "--output-file requirements.lock" in lock_rule
    assert LOCK.read_text().splitlines()[1].strip() == "#    make lock"  # the header names how to regenerate it
