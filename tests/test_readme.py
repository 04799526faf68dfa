"""The README's examples run as written and give what their comments say, and every install line in the README and
docs/ works as written: nsa is not on PyPI, so each installs it from a checkout or a built wheel, with extras
that exist."""

import configparser
import pathlib
import re
import shlex

import numpy as np
import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.fixture(scope="module")
def api():
    """The namespace after running every ```python block of the README's API section, in order."""
    section = README.read_text().split("## API\n\n", 1)[1].split("\n## ", 1)[0]
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_the_api_tour_runs(api):
    assert api["o"].shape == (1, 256, 4, 32)
    assert set(api["nsa"].implementations().values()) <= {"xla", "triton", "pallas"}


def test_the_defaults_are_the_selected_branch_alone(api):
    nsa, q, k, v = api["nsa"], api["q"], api["k"], api["v"]
    idx = nsa.select_blocks(q, nsa.compress(k, block_size=32), block_counts=4, block_size=32)
    _close(api["o_slc_only"], nsa.selected_attention(q, k, v, idx, block_size=32))


def test_the_cache_step_equals_the_full_recompute(api):
    full = api["nsa"].attention(*(api[n] for n in "qkv"), g_cmp=api["g_cmp"], block_counts=4, block_size=32,
                                window_size=64)
    _close(api["o_new"], full[:, -1:])


def test_the_cache_serves_a_learned_phi(api):
    full = api["nsa"].attention(*(api[n] for n in "qkv"), g_cmp=api["g_cmp"], k_cmp=api["k_phi"], v_cmp=api["v_phi"],
                                **api["blocks"], block_counts=4, window_size=64)
    _close(api["o_served"], full[:, 200:])


def test_the_context_parallel_step_equals_the_call_on_one_device(api):
    full = api["nsa"].attention(*(api[n] for n in "qkv"), g_cmp=api["g_cmp"], block_counts=4, block_size=32,
                                window_size=64)
    _close(api["o_cp"], full)


def test_the_ragged_paged_step_equals_the_full_recompute(api):
    nsa, q, k, v, o_step = api["nsa"], api["q"], api["k"], api["v"], np.asarray(api["o_step"])
    for b, (length, n) in enumerate([(121, 1), (103, 3)]):
        full = nsa.attention(q[:, :length], k[:, :length], v[:, :length], block_counts=4, block_size=32)
        _close(o_step[b, :n], full[0, -n:])
        assert not o_step[b, n:].any(), "the padding rows are 0"


def test_the_packed_batch_equals_each_row_alone(api):
    nsa, o_batch = api["nsa"], np.asarray(api["o_batch"])
    lens = np.asarray(api["mask"]).sum(axis=1)
    for row, n in enumerate(lens):
        alone = nsa.attention(*(api[name][row:row + 1, :n] for name in ("qb", "kb", "vb")), block_counts=4,
                              block_size=32)
        _close(o_batch[row, :n], alone[0])
        assert not o_batch[row, n:].any(), "unpack leaves zeros at the padding"


def test_the_layer_decode_step_equals_its_full_output(api):
    _close(api["y_last"], api["y"][:, -1:])


def _install_commands(page):
    """Every `pip install ...` of a page: the lines of its ```sh blocks and its inline code spans."""
    text = page.read_text()
    lines = [line for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S) for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]*pip install[^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        for start in [i for i in range(len(words) - 1) if words[i:i + 2] == ["pip", "install"]]:
            end = next((j for j in range(start + 2, len(words)) if words[j] in ("&&", ";", "|")), len(words))
            commands.append(words[start + 2:end])
    return commands


def test_the_readme_installs_with_every_backend_extra():
    targets = [target for command in _install_commands(README) for target in command]
    assert {".", ".[cuda]", ".[nnx]"} <= set(targets)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_install_line_works_as_written(page):
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    for command in _install_commands(page):
        for target in (word for word in command if not word.startswith("-")):
            if target.startswith("."):  # a checkout
                match = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", target)
                assert match, f"{page.name}: pip install {target}: not a checkout with extras"
                wanted = {extra.strip() for extra in (match.group(1) or "").split(",")} - {""}
                assert wanted <= extras, f"{page.name}: pip install {target}: no extra {wanted - extras} in setup.cfg"
            elif not target.startswith("dist/"):  # a built wheel, or a requirement from PyPI
                assert Requirement(target).name != "nsa", f"{page.name}: pip install {target}: nsa is not on PyPI"


def _anchor(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page):
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page.name} links {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in map(_anchor, headings), f"{page.name} links {link}: no such heading"


SOURCES = sorted(p for folder in ("nsa", "benchmarks", "examples", "notebooks", "scripts")
                 for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb", ".sh"))


def test_no_message_or_docstring_installs_nsa_from_pypi():
    """The package's own words (warnings, docstrings, notebooks) install nsa from a checkout too."""
    from_pypi = re.compile(r"pip install\s+['\"]?nsa\b")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES
             for n, line in enumerate(p.read_text().splitlines(), 1) if from_pypi.search(line)]
    assert not found, f"pip install nsa (not on PyPI) in {found}"


def test_the_papers_compression_and_a_learned_phi(api):
    """The section on the paper's compression: its windows are compress's where complete (rows 0 .. 30 of 32 at
    T = 256: row 31 holds 248 .. 255 only), and phi's weights get a gradient through nsa.attention."""
    nsa, jnp, jax = api["nsa"], api["jnp"], api["jax"]
    assert api["o_paper"].shape == api["o_phi"].shape == (1, 256, 4, 32)
    assert api["windows"].shape == (1, 32, 16, 1, 32) and api["in_window"].shape == (1, 32, 16)
    _close(api["k_phi"][:, :31], nsa.compress(api["k"], block_size=16, stride=8)[:, :31])
    q, k, v, g_cmp, phi, paper = (api[n] for n in ("q", "k", "v", "g_cmp", "phi", "paper"))

    def loss(weights):
        rows = [phi(nsa.compression_windows(x, block_size=16, stride=8)[0], weights) for x in (k, v)]
        return jnp.sum(nsa.attention(q, k, v, g_cmp=g_cmp, k_cmp=rows[0], v_cmp=rows[1], **paper) ** 2)

    grad = jax.grad(loss)(api["weights"])
    assert grad.shape == (16,) and np.all(np.isfinite(grad)) and np.all(grad != 0)
