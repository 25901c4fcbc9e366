"""Queue types: the arguments a RabbitMQ queue of each type is declared with, and the setting that picks it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from apiary.bus.rabbitmq.topology import type_arguments
from apiary.settings import Settings


def test_a_classic_queue_takes_no_type_arguments() -> None:
    assert type_arguments("classic", 20) == {}


def test_a_quorum_queue_says_its_type_and_its_delivery_limit() -> None:
    assert type_arguments("quorum", 7) == {"x-queue-type": "quorum", "x-delivery-limit": 7}
    assert type_arguments("quorum") == {"x-queue-type": "quorum"}


def test_an_unknown_queue_type_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'stream' is not supported: expected one of classic, quorum"):
        type_arguments("stream")


def test_the_setting_reads_apiary_queue_type_and_defaults_to_classic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIARY_QUEUE_TYPE", raising=False)
    assert Settings().queue_type == "classic"
    monkeypatch.setenv("APIARY_QUEUE_TYPE", "quorum")
    monkeypatch.setenv("APIARY_QUEUE_DELIVERY_LIMIT", "5")
    assert (Settings().queue_type, Settings().queue_delivery_limit) == ("quorum", 5)
    monkeypatch.setenv("APIARY_QUEUE_TYPE", "mirrored")
    with pytest.raises(ValidationError):
        Settings()
