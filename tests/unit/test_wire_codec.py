"""distributed.transfer's wire formats: halved downloads, encoded uploads, and the bound a quantised round keeps to."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save

from apiary.jobspec import DistributedConfig
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.weights import WeightsError, dumps, loads, spec_of_tensors
from apiary.wire_codec import (
    SCALES,
    UPDATE_KEY,
    decode_update,
    encode_update,
    halve,
    int8_bound,
    is_encoded,
    load_downloaded,
    needs_base,
)
from apiary.wire_settings import TransferSettings


def _model(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(37, 29, generator=g) * scale, "a.bias": torch.randn(29, generator=g) * scale,
            "steps": torch.tensor(seed, dtype=torch.int64)}


def _fedavg(contributions: list[tuple[dict[str, torch.Tensor], int]],
            spec_from: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    strategy = create("federated_averaging")
    strategy.begin(spec_of_tensors(spec_from), UpdateFormat.FULL)
    for weights, samples in contributions:
        strategy.accept(Contribution(weights, samples))
    return strategy.finish().weights


def test_default_transfer_is_plain_fp32_and_encodes_nothing() -> None:
    settings = DistributedConfig().transfer

    assert settings == TransferSettings(download="fp32", upload="fp32", delta=False)
    assert not settings.encodes_upload


@pytest.mark.parametrize("bad", [{"upload": "int4"}, {"download": "int8_blockwise"}, {"block_size": 32},
                                 {"block_size": 100}, {"block_size": 8192}, {"compress": True}])
def test_malformed_transfer_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        DistributedConfig(transfer=bad)  # type: ignore[arg-type]


def test_plain_weights_decode_as_they_are() -> None:
    weights = _model(1)

    data = dumps(weights)

    assert not is_encoded(data)
    decoded = decode_update(data)
    assert all(torch.equal(decoded[n], weights[n]) for n in weights)


def test_halved_download_casts_floats_back_to_their_dtypes() -> None:
    weights = _model(2)

    data = halve(weights, "bf16")
    back = load_downloaded(data)

    assert len(data) < len(dumps(weights)) * 0.6
    assert loads(data)["a.weight"].dtype == torch.bfloat16
    assert {n: t.dtype for n, t in back.items()} == {n: t.dtype for n, t in weights.items()}
    torch.testing.assert_close(back["a.weight"], weights["a.weight"].to(torch.bfloat16).float())
    assert torch.equal(back["steps"], weights["steps"])


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8_blockwise"])
def test_a_delta_upload_decodes_to_the_trained_weights_within_its_encoding(encoding: str) -> None:
    base, trained = _model(3), _model(4)

    data = encode_update(trained, base, encoding, block_size=64)
    decoded = decode_update(data, base)

    assert needs_base(data)
    assert torch.equal(decoded["steps"], trained["steps"])
    delta = trained["a.weight"] - base["a.weight"]
    tolerance = {"fp32": 1e-6, "bf16": 2**-8, "fp16": 2**-11}.get(encoding)
    error = (decoded["a.weight"] - trained["a.weight"]).abs()
    if tolerance is None:
        assert bool((error <= int8_bound(delta, 64) + 1e-6).all())
    else:
        assert bool((error <= delta.abs() * tolerance + 1e-6).all())


def test_int8_blockwise_is_about_a_quarter_of_fp32() -> None:
    trained = {"w": torch.randn(1024, 1024)}

    data = encode_update(trained, None, "int8_blockwise", block_size=256)

    assert len(data) < len(dumps(trained)) * 0.26
    assert not needs_base(data)


def test_a_quantised_round_differs_from_the_fp32_round_by_no_more_than_the_quantisation_bound() -> None:
    base = _model(10)
    trained = [{**_model(20 + i, scale=0.05), "steps": base["steps"]} for i in range(4)]
    trained = [{n: (base[n] + t[n]) if t[n].is_floating_point() else t[n] for n in t} for t in trained]
    samples = [5, 3, 9, 1]
    block = 128

    exact = _fedavg(list(zip(trained, samples, strict=True)), base)
    received = [decode_update(encode_update(t, base, "int8_blockwise", block), base) for t in trained]
    quantised = _fedavg(list(zip(received, samples, strict=True)), base)

    for name in ("a.weight", "a.bias"):
        # Each contribution is off by at most absmax(its delta's block) / 254; a weighted mean by at most the
        # largest of those; float32 sums add a few ulps of the values.
        bound = torch.stack([int8_bound(t[name] - base[name], block) for t in trained]).amax(dim=0)
        ulps = exact[name].abs() * 4 * torch.finfo(torch.float32).eps
        error = (quantised[name] - exact[name]).abs()
        assert bool((error <= bound + ulps).all()), float((error - bound).max())
        assert float(error.max()) > 0  # quantisation did change something: the test can fail
    assert torch.equal(quantised["steps"], exact["steps"])


def test_fp32_full_uploads_stay_exact() -> None:
    base = _model(30)
    trained = [_model(31), _model(32)]

    plain = _fedavg([(t, 2) for t in trained], base)
    through_wire = _fedavg([(decode_update(encode_update(t, None, "fp32"), None), 2) for t in trained], base)

    assert all(torch.equal(plain[n], through_wire[n]) for n in plain)


def _encoded(meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors, metadata={UPDATE_KEY: json.dumps(meta)})


@pytest.mark.parametrize("tamper", ["bad_json", "missing_scales", "short_codes", "negative_scale", "nan_scale",
                                    "wrong_dtype_name", "extra_tensor", "delta_without_base"])
def test_malformed_uploads_raise_one_weights_error(tamper: str) -> None:
    base = {"w": torch.ones(100)}
    good = {"v": 1, "delta": False, "encoding": "int8_blockwise", "block_size": 64, "dtypes": {"w": "F32"},
            "shapes": {"w": [100]}}
    tensors = {"w": torch.zeros(128, dtype=torch.int8), "w" + SCALES: torch.ones(2)}
    meta: dict[str, object] = dict(good)
    if tamper == "bad_json":
        data = save(tensors, metadata={UPDATE_KEY: "{not json"})
    else:
        if tamper == "missing_scales":
            del tensors["w" + SCALES]
        elif tamper == "short_codes":
            tensors["w"] = torch.zeros(64, dtype=torch.int8)
        elif tamper == "negative_scale":
            tensors["w" + SCALES] = torch.tensor([1.0, -1.0])
        elif tamper == "nan_scale":
            tensors["w" + SCALES] = torch.tensor([1.0, float("nan")])
        elif tamper == "wrong_dtype_name":
            meta["dtypes"] = {"w": "F128"}
        elif tamper == "extra_tensor":
            tensors["x"] = torch.zeros(1)
        elif tamper == "delta_without_base":
            meta["delta"] = True
        data = _encoded(meta, tensors)

    with pytest.raises(WeightsError):
        decode_update(data, None if tamper == "delta_without_base" else base)
