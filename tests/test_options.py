from __future__ import annotations

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


def test_renew_interval_follows_lease() -> None:
    assert EmqOptions.from_transport_options({"lease_ms": 3000}).renew_interval_ms == 1000


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
    ],
)
def test_invalid_option_is_named(opts: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidOptionError) as info:
        EmqOptions.from_transport_options(opts)
    assert info.value.option == name
    assert name in str(info.value)
