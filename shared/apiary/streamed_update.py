"""An encoded upload (`distributed.transfer`: a delta, half precision, int8 blockwise) folded straight from storage:
its stored chunks (`apiary.streamed_weights`) decoded one by one into the round's dtypes as they arrive, never the
whole contribution, with the same bits as decoding it whole (`apiary.wire_codec.decode_update`).

Block scales are small (4 bytes per block) and safetensors stores them before the int8 codes (wider dtypes first),
so they are in by the time the codes they scale arrive; a file ordered otherwise has a tensor's scales read first."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from apiary.streamed_weights import StreamedWeights
from apiary.weights import TensorSpec, WeightsError, WeightSpec
from apiary.wire_codec import SCALES, check_scales, decode_values, encoding_of, reference_of

DECODED = 2**22  # values decoded at once (16 MiB in float32), whatever a read holds


class StreamedUpdate(Mapping[str, torch.Tensor]):
    """The weights an encoded upload read by `stored` stands for (decoded chunk by chunk: `chunks`); `base`, the
    round's global weights, for a delta. WeightsError (one line) if the upload is malformed."""

    def __init__(self, stored: StreamedWeights, base: Mapping[str, torch.Tensor] | None) -> None:
        coded = encoding_of(stored.metadata)
        if coded is None:
            raise WeightsError("the object is plain weights, not an encoded upload")
        if coded.delta and base is None:
            raise WeightsError("the upload is a delta but no global weights were given to add it to")
        have, expected = set(stored.declared_spec), coded.stored_names()
        if have != expected:
            raise WeightsError(f"upload tensors differ from its metadata: extra {sorted(have - expected)[:3]}, "
                               f"missing {sorted(expected - have)[:3]}")
        self._stored, self._coded, self._base = stored, coded, base if coded.delta else None
        self.metadata = stored.metadata
        self._numel: dict[str, int] = {}
        for name in coded.dtypes:
            scales = stored.declared_spec.get(name + SCALES)
            self._numel[name] = coded.check_stored(name, _counted(stored.declared_spec[name]),
                                                   None if scales is None else _counted(scales))
        self.declared_spec: WeightSpec = {n: TensorSpec(d, tuple(coded.shapes[n])) for n, d in coded.dtypes.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        """One tensor decoded whole (strategies that fold stream through `chunks` instead)."""
        coded = self._coded
        if name not in coded.dtypes:
            raise KeyError(name)
        stored = self._stored[name].reshape(-1)
        if not coded.dtypes[name].is_floating_point:
            return stored.view(coded.shapes[name])
        scales = self._scales(name)
        return decode_values(coded, name, stored, scales, 0, self._numel[name], self._reference(name)).view(
            coded.shapes[name])

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._stored if name in self._coded.dtypes)

    def __len__(self) -> int:
        return len(self._coded.dtypes)

    def chunks(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(tensor name, element offset, flat values in the round's dtype) in file order, at most a read's worth
        each, as `StreamedWeights.chunks` gives plain weights (`WeightedSum.fold` takes these)."""
        coded = self._coded
        scales: dict[str, torch.Tensor] = {}
        filled: dict[str, int] = {}
        for name, at, values in self._stored.chunks():
            if name.endswith(SCALES):  # gathered as they arrive, before the codes they scale
                owner = name[: -len(SCALES)]
                held = scales.setdefault(owner, torch.empty(self._stored.declared_spec[name].shape[0]))
                held[at : at + values.numel()] = values
                filled[owner] = filled.get(owner, 0) + values.numel()
                if filled[owner] == held.numel():
                    check_scales(owner, held)
                continue
            if not coded.dtypes[name].is_floating_point:
                yield name, at, values
                continue
            count = max(0, min(values.numel(), self._numel[name] - at))  # int8 codes pad their last block
            if coded.encoding == "int8_blockwise" and filled.get(name, -1) != self._numel_scales(name):
                read = self._scales(name)  # an order safetensors does not write: read them first
                assert read is not None
                scales[name], filled[name] = read, read.numel()
            if not self._numel[name]:
                yield name, at, decode_values(coded, name, values, scales.get(name), at, 0, self._reference(name))
            for start in range(0, count, DECODED):  # a read of int8 codes is 4x as many bytes once decoded
                yield name, at + start, decode_values(coded, name, values[start:], scales.get(name), at + start,
                                                      min(DECODED, count - start), self._reference(name))

    def _numel_scales(self, name: str) -> int:
        return self._stored.declared_spec[name + SCALES].shape[0]

    def _scales(self, name: str) -> torch.Tensor | None:
        if self._coded.encoding != "int8_blockwise":
            return None
        scales = self._stored[name + SCALES].reshape(-1)
        check_scales(name, scales)
        return scales

    def _reference(self, name: str) -> torch.Tensor | None:
        return None if self._base is None else reference_of(name, self._coded.shapes[name], self._base)


def _counted(spec: TensorSpec) -> tuple[torch.dtype, int]:
    return spec.dtype, math.prod(spec.shape)
