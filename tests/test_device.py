"""nsa._device: the facts of a device in the table, of one off the table (the smallest values, said once), and
of a target named for export from a machine without that device."""

import warnings

import pytest

from nsa import _device


def test_a_known_device_gives_its_row(monkeypatch):
    monkeypatch.setattr(_device, "_local_kind", lambda platform: "NVIDIA H100 PCIe")
    assert _device.facts("cuda").cores == 114 and _device.facts("cuda").shared_memory == 227 * 1024


def test_aliases_name_the_same_row(monkeypatch):
    monkeypatch.setattr(_device, "_local_kind", lambda platform: "TPU v5e")
    assert _device.facts("tpu") is _device.TABLE["TPU v5 lite"]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_conservative_row_is_at_most_every_device(platform):
    rows = [d for d in _device.TABLE.values() if d.platform == platform]
    small = _device.CONSERVATIVE[platform]
    for field in ("cores", "shared_memory", "registers", "l2", "vmem", "scoped_vmem", "bandwidth"):
        assert getattr(small, field) == min(getattr(d, field) for d in rows), field


def test_an_unknown_device_warns_once_per_platform_and_kind(monkeypatch):
    monkeypatch.setattr(_device, "_warned", set())
    monkeypatch.setattr(_device, "_local_kind", lambda platform: f"a new {platform} device")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert _device.facts("tpu") == _device.CONSERVATIVE["tpu"]
            assert _device.facts("cuda") == _device.CONSERVATIVE["cuda"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "'a new tpu device'" in messages[0] and "'a new cuda device'" in messages[1], messages


def test_no_device_plans_with_the_smallest_values_silently(monkeypatch):
    """Exporting for a platform this process has no device of (or tracing its branch for shapes) warns nothing."""
    monkeypatch.setattr(_device, "_local_kind", lambda platform: None)
    monkeypatch.delenv("NSA_DEVICE_KIND", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _device.facts("cuda") == _device.CONSERVATIVE["cuda"]


def test_nsa_device_kind_names_the_export_target(monkeypatch):
    monkeypatch.setattr(_device, "_local_kind", lambda platform: None)
    monkeypatch.setenv("NSA_DEVICE_KIND", "NVIDIA H200")
    assert _device.facts("cuda") is _device.TABLE["NVIDIA H200"]
    with pytest.raises(ValueError, match="NSA_DEVICE_KIND must name a tpu device"):
        _device.facts("tpu")
    monkeypatch.setattr(_device, "_local_kind", lambda platform: "NVIDIA A100-SXM4-80GB")
    assert _device.facts("cuda").cores == 108  # a device here wins over the variable


def test_an_unknown_platform_raises():
    with pytest.raises(ValueError, match="platform must be one of"):
        _device.facts("rocm")
