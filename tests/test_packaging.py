"""The package is ready to publish: the sdist and wheel that `python -m build` makes pass `twine check`, hold what a
user needs and nothing of the test suite, and carry the metadata PyPI shows.

Both are built once, offline (`--no-isolation`: the build backend comes from the `test` extra), the wheel from the
sdist, as `python -m build` does: so the sdist is complete enough to build it.
"""

import email.parser
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata

import pytest
import trove_classifiers
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG_DESCRIPTION_LINES = 40  # a PyPI page's description, not the README


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def wheel_metadata(dists):
    with zipfile.ZipFile(dists[1]) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(wheel.read(name).decode())


def _package_files():
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "nsa").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_twine_check_passes(dists):
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wheel_holds_the_whole_package_typed_and_no_tests(dists):
    with zipfile.ZipFile(dists[1]) as wheel:
        names = set(wheel.namelist())
    assert "nsa/py.typed" in names
    assert _package_files() <= names, f"missing from the wheel: {sorted(_package_files() - names)}"
    assert not [n for n in names if n.startswith("tests/")]


def test_the_sdist_holds_the_package_license_readme_and_docs(dists):
    with tarfile.open(dists[0]) as sdist:
        top, *_ = sdist.getnames()
        names = {n.removeprefix(top + "/") for n in sdist.getnames()}
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    needed = {"LICENSE", "README.md", "pyproject.toml", "setup.cfg"} | docs | _package_files()
    assert needed <= names, f"missing from the sdist: {sorted(needed - names)}"
    assert not [n for n in names if n.startswith("tests/")]


def test_runtime_requirements_are_jax_with_a_lower_bound_and_numpy(wheel_metadata):
    runtime = [Requirement(r) for r in wheel_metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.name for r in runtime) == ["jax", "numpy"], "jax brings jaxlib; chex is for the tests"
    (jax,) = [r for r in runtime if r.name == "jax"]
    assert [s.operator for s in jax.specifier] == [">="]
    assert jax.specifier.contains(metadata.version("jax")), f"the jax under test is outside {jax}"


def test_the_test_extra_holds_what_the_suite_imports(wheel_metadata):
    test = [Requirement(r) for r in wheel_metadata.get_all("Requires-Dist") if 'extra == "test"' in r]
    names = {r.name for r in test}
    assert {"chex", "nbformat", "build", "twine", "optax"} <= names
    assert {"demo", "notebooks", "nnx"} <= {e for r in test if r.name == "nsa" for e in r.extras}


def test_classifiers_license_and_urls(wheel_metadata):
    classifiers = wheel_metadata.get_all("Classifier")
    assert set(classifiers) <= trove_classifiers.classifiers, "PyPI refuses an unknown classifier"
    for wanted in ("Operating System ::", "Programming Language :: Python :: 3.11",
                   "Programming Language :: Python :: 3.12", "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert any(c.startswith(wanted) for c in classifiers), wanted
    assert wheel_metadata["License-Expression"] == "Apache-2.0"
    assert any("arxiv.org/abs/2502.11089" in url for url in wheel_metadata.get_all("Project-URL"))


def test_the_long_description_is_short_with_absolute_links_only(wheel_metadata):
    description = wheel_metadata.get_payload()
    assert 0 < len(description.strip().splitlines()) <= LONG_DESCRIPTION_LINES
    links = re.findall(r"\]\(([^)]*)\)", description)
    assert all(re.match(r"https?://", link) for link in links), f"relative links break on PyPI: {links}"
