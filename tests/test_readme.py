"""The README's API examples run as written: the API tour, then the KV-cache snippet after it, whose output
is what it says."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_api_examples_run():
    api = README.read_text().split("## API\n\n", 1)[1]
    example, serving = re.findall(r"```python\n(.*?)```", api, re.S)[:2]
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    assert namespace["o"].shape == (1, 256, 4, 32)
    assert set(namespace["nsa"].implementations().values()) <= {"xla", "triton", "pallas"}
    exec(compile(serving, str(README), "exec"), namespace)
    full = namespace["nsa"].attention(*(namespace[n] for n in "qkv"), g_cmp=namespace["g_cmp"], block_counts=4,
                                      block_size=32, window_size=64)
    np.testing.assert_allclose(namespace["o_new"], full[:, -1:], rtol=1e-5, atol=1e-5)
