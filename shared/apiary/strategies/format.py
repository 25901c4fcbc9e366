"""What a contribution's weights cover: the whole model, or adapter tensors over a frozen base."""

from __future__ import annotations

import enum


class UpdateFormat(enum.StrEnum):
    """The shape of an update, declared for the round and honoured by every strategy."""

    FULL = "full"  # every tensor of the global model
    ADAPTER = "adapter"  # a subset (e.g. LoRA); the tensors not sent keep the global model's values

    @classmethod
    def of(cls, *, adapter_only: bool) -> UpdateFormat:
        """ADAPTER where only adapter tensors travel (a job's `use_peft`), else FULL."""
        return cls.ADAPTER if adapter_only else cls.FULL
