from __future__ import annotations

import logging

import pytest

from celery_emq import EmqOptions, InvalidOptionError


def test_defaults() -> None:
    o = EmqOptions.from_transport_options({})
    assert (o.lease_ms, o.renew_interval_ms, o.claim_batch, o.key_prefix) == (
        30_000,
        10_000,
        64,
        "emq",
    )


@pytest.mark.parametrize(
    ("opts", "max_lapsed"),
    [
        ({}, 8),
        ({"max_stalled": 0}, 4),
        ({"max_stalled": 3}, 16),
        ({"max_stalled": None}, None),
        ({"max_stalled": None, "max_lapsed": 5}, 5),
        ({"max_stalled": 1, "max_lapsed": None}, None),
        ({"max_lapsed": 1}, 1),
    ],
)
def test_max_lapsed_defaults_to_four_times_the_stalls_a_job_may_make(
    opts: dict[str, object], max_lapsed: int | None
) -> None:
    assert EmqOptions.from_transport_options(opts).max_lapsed == max_lapsed


def test_renew_interval_follows_lease() -> None:
    assert EmqOptions.from_transport_options({"lease_ms": 3000}).renew_interval_ms == 1000


@pytest.mark.parametrize("retries", [-1, 11, 1.5, True, "1"])
def test_command_retries_out_of_range_is_named(retries: object) -> None:
    with pytest.raises(InvalidOptionError) as info:
        EmqOptions.from_transport_options({"command_retries": retries})
    assert info.value.option == "command_retries"
    assert "command_retries" in str(info.value)
    assert EmqOptions.from_transport_options({}).command_retries == 0
    assert EmqOptions.from_transport_options({"command_retries": 10}).command_retries == 10


def test_global_keyprefix_goes_in_front() -> None:
    o = EmqOptions.from_transport_options({"global_keyprefix": "app1:", "key_prefix": "jobs"})
    assert o.key_prefix == "app1:jobs"


@pytest.mark.parametrize(
    ("opts", "name"),
    [
        ({"lease_ms": 10}, "lease_ms"),
        ({"lease_ms": "30000"}, "lease_ms"),
        ({"lease_ms": True}, "lease_ms"),
        ({"lease_ms": 3000, "renew_interval_ms": 2000}, "renew_interval_ms"),
        ({"claim_batch": 0}, "claim_batch"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"max_lapsed": 0}, "max_lapsed"),
        ({"max_lapsed": "8"}, "max_lapsed"),
        ({"max_lapsed": True}, "max_lapsed"),
    ],
)
def test_invalid_option_is_named(opts: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidOptionError) as info:
        EmqOptions.from_transport_options(opts)
    assert info.value.option == name
    assert name in str(info.value)


def test_a_misspelt_option_warns_once_naming_ours(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="celery_emq.options"):
        EmqOptions.from_transport_options({"lease_msec": 5000})
        EmqOptions.from_transport_options({"lease_msec": 5000})
    warned = [r.getMessage() for r in caplog.records if "lease_msec" in r.getMessage()]
    assert len(warned) == 1
    assert "'lease_msec'" in warned[0] and "'lease_ms'" in warned[0]


def test_other_transports_options_and_far_names_pass_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="celery_emq.options"):
        EmqOptions.from_transport_options(
            {
                # kombu's own Redis options, Celery's publish retry ones, and a
                # name close to none of ours.
                "visibility_timeout": 3600,
                "polling_interval": 1,
                "interval_start": 0,
                "interval_step": 0.2,
                "interval_max": 0.5,
                "max_retries": 3,
                "socket_timeout": 5,
                "queue_order_strategy": "priority",
                "something_else": 1,
            }
        )
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize(
    ("lease_ms", "interval_s"),
    [(500, 500 / 3000), (3000, 1.0), (5000, 5 / 3), (15_000, 5.0), (30_000, 5.0), (600_000, 5.0)],
)
def test_the_sweep_interval_default_is_a_third_of_the_lease_at_most_5s(
    lease_ms: int, interval_s: float
) -> None:
    options = EmqOptions.from_transport_options({"lease_ms": lease_ms})
    assert options.sweep_interval_s == pytest.approx(interval_s)


def test_the_default_sweep_interval_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    # The default is lease_ms / 3000, the very bound the warning checks: no lease,
    # however it rounds, may warn about its own default (548 ms once did).
    with caplog.at_level(logging.WARNING, logger="celery_emq.options"):
        for lease_ms in [*range(500, 15_001), 10_800_000]:
            options = EmqOptions.from_transport_options({"lease_ms": lease_ms})
            assert options.sweep_interval_s <= min(5.0, lease_ms / 3000)
            EmqOptions.from_transport_options(
                {"lease_ms": lease_ms, "sweep_interval_s": lease_ms / 3000}
            )
    assert [r.getMessage() for r in caplog.records] == []


def test_a_long_sweep_interval_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="celery_emq.options"):
        for _ in range(5):
            EmqOptions.from_transport_options({"lease_ms": 5000})
        assert caplog.records == []
        for _ in range(5):
            EmqOptions.from_transport_options({"lease_ms": 5001, "sweep_interval_s": 5})
    assert [r.getMessage().count("sweep_interval_s=5") for r in caplog.records] == [1]


def test_a_bound_set_by_another_option_names_it() -> None:
    with pytest.raises(InvalidOptionError) as info:
        EmqOptions.from_transport_options({"lease_ms": 3000, "renew_interval_ms": 2000})
    assert str(info.value) == (
        "invalid transport option renew_interval_ms=2000: expected an integer from 100 to 1499 "
        "(less than lease_ms / 2, with lease_ms=3000: a lease is renewed at least twice "
        "before it lapses)"
    )
