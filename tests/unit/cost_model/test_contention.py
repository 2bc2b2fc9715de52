"""The SMs a collective holds while it runs beside compute (cost_model/contention.py)."""

import pytest

from cost_model.contention import overlap_slowdown_s, sm_share
from cost_model.hardware import SYSTEMS


def test_the_share_is_the_collectives_blocks_over_the_devices_sms() -> None:
    assert sm_share(16, 132) == pytest.approx(16 / 132)
    assert sm_share(200, 132) == 1.0


def test_unknown_channels_or_sms_price_nothing() -> None:
    assert sm_share(0, 132) == 0.0
    assert sm_share(16, 0) == 0.0
    assert overlap_slowdown_s(1.0, channels=0, sm_count=132) == 0.0


def test_the_delay_grows_with_the_overlapped_seconds_and_the_channels() -> None:
    one = overlap_slowdown_s(0.01, channels=16, sm_count=132)
    assert overlap_slowdown_s(0.02, channels=16, sm_count=132) == pytest.approx(2 * one)
    assert overlap_slowdown_s(0.01, channels=32, sm_count=132) == pytest.approx(2 * one)
    assert overlap_slowdown_s(0.0, channels=16, sm_count=132) == 0.0


def test_the_gpu_systems_know_their_sms_and_nccls_channels() -> None:
    h100, a100 = SYSTEMS["dgx-h100"], SYSTEMS["dgx-a100-80g"]
    assert (h100.device.sm_count, h100.collectives.channels) == (132, 16)
    assert (a100.device.sm_count, a100.collectives.channels) == (108, 24)


def test_negative_figures_are_refused() -> None:
    from dataclasses import replace
    with pytest.raises(ValueError, match="sm_count"):
        replace(SYSTEMS["dgx-h100"].device, sm_count=-1)
    with pytest.raises(ValueError, match="channels"):
        replace(SYSTEMS["dgx-h100"].collectives, channels=-1)
