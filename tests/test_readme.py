"""The README's API example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_api_example_runs():
    example = re.search(r"## API\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    assert namespace["o"].shape == (1, 256, 4, 32)
    assert set(namespace["nsa"].implementations().values()) <= {"xla", "triton", "pallas"}
