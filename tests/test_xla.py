"""The shared test base on the XLA reference (implementation="xla"), float64 included."""

from tests.base import ALL_DTYPES, NSATestBase


class TestXLA(NSATestBase):
    implementation = "xla"
    dtypes = tuple(ALL_DTYPES)
