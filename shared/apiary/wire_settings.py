"""How a job's weights travel (`distributed.transfer`): the precision of the global weights workers download,
and what they upload (the trained weights or their delta from the round's global weights, in full precision,
half precision or 8-bit blockwise). Torch-free: the tracker validates job requests too."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DownloadPrecision = Literal["fp32", "bf16", "fp16"]
UploadEncoding = Literal["fp32", "bf16", "fp16", "int8_blockwise"]
MIN_BLOCK, MAX_BLOCK = 64, 4096


class TransferSettings(BaseModel):
    """The wire format of a job's weights; the default (`fp32` both ways, no delta) is today's exact behaviour."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    download: DownloadPrecision = Field(default="fp32", description="precision of the global weights workers "
                                        "download: fp32 as stored, or bf16 / fp16 (floating tensors halved; the "
                                        "worker casts them back to their dtype before training)")
    upload: UploadEncoding = Field(default="fp32", description="encoding of the floating tensors workers upload: "
                                   "fp32 as trained, bf16 / fp16, or int8_blockwise (absmax per block of "
                                   "block_size values); the aggregator decodes before summing in full precision")
    delta: bool = Field(default=False, description="upload the difference from the round's global weights "
                        "instead of the weights (the aggregator adds it back); recommended with int8_blockwise")
    block_size: int = Field(default=256, ge=MIN_BLOCK, le=MAX_BLOCK, description="values per absmax block of "
                            "int8_blockwise (64 to 4096)")
    part_size_mib: int = Field(default=64, ge=5, le=5120, description="MiB per part of a multipart upload: "
                               "results larger than one part go up in parts, several at once, resumable")
    keep_contributions: bool = Field(default=False, description="keep every round's uploaded contributions in "
                                     "storage; by default a finished round's are deleted once a later round's "
                                     "result is stored (the last round's are kept)")

    @model_validator(mode="after")
    def _power_of_two(self) -> TransferSettings:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, "
                             f"got {self.block_size}")
        return self

    def in_parts(self, size: int) -> bool:
        """Whether a result of about `size` bytes goes up in parts (a multipart upload), not in one request."""
        return size > self.part_size_mib * 2**20

    @property
    def encodes_upload(self) -> bool:
        """Whether a worker rewrites its result before upload (anything but fp32 weights)."""
        return self.delta or self.upload != "fp32"
